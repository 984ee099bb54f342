"""Which file, if any, backs an address of this process (Linux's /proc/self/maps), for tests that check
whose memory a tensor lives in."""

from __future__ import annotations

from pathlib import Path

import pytest

MAPS = Path("/proc/self/maps")

needs_proc_maps = pytest.mark.skipif(not MAPS.exists(), reason="reads Linux's /proc/self/maps")


def mapped_file(address: int) -> str:
    """The file mapped at `address` ('' for anonymous memory, '[heap]' and such: the kernel's names)."""
    for line in MAPS.read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(part, 16) for part in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) == 6 else ""
    raise AssertionError(f"{address:#x} is not mapped")
