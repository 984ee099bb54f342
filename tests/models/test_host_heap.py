"""`keep_freed_memory`: later rounds of large allocations reuse the first round's pages instead of faulting
them in again."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from tether.models import host_heap
from tether.models.host_heap import M_MMAP_MAX, M_TRIM_THRESHOLD, NEVER_TRIM, keep_freed_memory

# A fresh process allocates, fills and frees six blocks of 48 MiB (over glibc's largest mmap threshold),
# with small tensors between, eight times, and reports the page faults of the last three rounds: 73,728
# pages a round come from the kernel again unless freed memory is kept. Kept, the heap settles within a
# few rounds (the first ones may still grow it: a small block can split a freed large one).
_PROGRAM = """
import json, resource, sys, torch
from tether.models.host_heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "kept" else False
def faults_of_a_round():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.empty(48 << 20, dtype=torch.uint8).fill_(1) for _ in range(6)]
    small = [torch.empty(100) for _ in range(50)]
    del blocks, small
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
rounds = [faults_of_a_round() for _ in range(8)]
print(json.dumps({"kept": kept, "faults": sum(rounds[-3:])}))
"""


def _last_round(mode: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM, mode], capture_output=True, text=True, timeout=120, check=True
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")
def test_kept_freed_memory_serves_later_rounds_of_large_allocations_without_page_faults() -> None:
    default, kept = _last_round("default"), _last_round("kept")
    assert default["kept"] is False and kept["kept"] is True
    assert isinstance(default["faults"], int) and default["faults"] > 3 * 60_000  # 73,728 pages a round
    assert isinstance(kept["faults"], int) and kept["faults"] < 20_000


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
