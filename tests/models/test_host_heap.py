"""`keep_freed_memory`: a second large allocation reuses the first one's pages instead of faulting them."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from tether.models import host_heap
from tether.models.host_heap import M_MMAP_MAX, M_TRIM_THRESHOLD, NEVER_TRIM, keep_freed_memory

# A fresh process allocates, fills and frees 256 MiB twice and reports the page faults of the second
# fill: 65,536 pages come from the kernel again unless freed memory is kept.
_PROGRAM = """
import json, resource, sys, torch
from tether.models.host_heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "kept" else False
def faults_of_a_fill():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.empty(256 << 20, dtype=torch.uint8).fill_(1)
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_a_fill()
print(json.dumps({"kept": kept, "faults": faults_of_a_fill()}))
"""


def _second_fill(mode: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM, mode], capture_output=True, text=True, timeout=120, check=True
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")
def test_kept_freed_memory_serves_a_second_large_allocation_without_page_faults() -> None:
    default, kept = _second_fill("default"), _second_fill("kept")
    assert default["kept"] is False and kept["kept"] is True
    assert isinstance(default["faults"], int) and default["faults"] > 30_000  # the 65,536 pages, refaulted
    assert isinstance(kept["faults"], int) and kept["faults"] < 2_000


def test_both_settings_are_asked_for_and_a_refusal_reads_false() -> None:
    calls: list[tuple[int, int]] = []

    def accepting(param: int, value: int) -> int:
        calls.append((param, value))
        return 1

    assert keep_freed_memory(accepting) is True
    assert calls == [(M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER_TRIM)]
    assert keep_freed_memory(lambda param, value: 0) is False


def test_another_c_library_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert host_heap.glibc_mallopt() is None
    assert keep_freed_memory() is False
