"""Size torch's CPU thread pool to the cores really free: oversubscribed torch runs many times slower.

Measured on the 2-core development machine with another process busy on one core: a [64, 576] x
[576, 1536] matmul took 17 ms with 2 threads and 1.8 ms with 1, because every parallel region waits for a
thread the kernel has not scheduled. So the count is the cores idle right now (sampled from /proc/stat
over a short window), not the cores the process may use. The sample is taken once, when a long-running
job starts; it does not follow load that arrives later.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

from tether.machine import available_cores as available_cores  # re-exported: it moved below models

PROC_STAT = Path("/proc/stat")
# A core at least half idle counts as free. Three quarters was too strict: on an otherwise quiet machine
# the kernel's own housekeeping and a shell left 1.7 idle cores of 2 in a 0.2 s sample, and a benchmark
# ran on one thread. Where other work keeps a core half busy, engine lanes (`ModelRunner`) cost less.
FREE_CORE_THRESHOLD = 0.5


def cpu_times(stat_text: str) -> tuple[int, int]:
    """(idle, total) jiffies summed over every CPU, from the aggregate `cpu` line of /proc/stat."""
    for line in stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(value) for value in fields[1:]]
            if len(values) < 4:
                break
            idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
            return idle, sum(values[:8])  # guest times are already inside user and nice
    raise ValueError("no aggregate 'cpu' line with at least 4 fields in /proc/stat")


def idle_cores(before: tuple[int, int], after: tuple[int, int], cores: int) -> float:
    """Cores idle between two `cpu_times` samples of a machine with `cores` CPUs."""
    total = after[1] - before[1]
    if total <= 0:
        return float(cores)
    return cores * max(0, after[0] - before[0]) / total


def read_cpu_times() -> tuple[int, int] | None:
    """`cpu_times` of this machine now, or None where /proc/stat cannot be read."""
    try:
        return cpu_times(PROC_STAT.read_text())
    except (OSError, ValueError):
        return None


def free_cores(window_s: float = 0.5) -> int | None:
    """Cores idle over the next `window_s` seconds, or None where /proc/stat cannot be read."""
    before = read_cpu_times()
    if before is None:
        return None
    time.sleep(window_s)
    after = read_cpu_times()
    if after is None:
        return None
    cores = os.cpu_count() or 1
    return math.floor(idle_cores(before, after, cores) + 1 - FREE_CORE_THRESHOLD)


def configure_threads(reserved_cores: int = 0, max_threads: int | None = None) -> int:
    """Set torch's intra-op threads to the free cores (minus `reserved_cores`); returns the count set."""
    if reserved_cores < 0:
        raise ValueError(f"reserved_cores must be >= 0, got {reserved_cores}")
    cores = available_cores()
    free = free_cores()
    threads = max(1, min(cores, cores if free is None else free) - reserved_cores)
    if max_threads is not None:
        threads = max(1, min(threads, max_threads))
    torch.set_num_threads(threads)
    return threads


def strict_matmul() -> bool:
    """Ask MKL for results that do not depend on how a matmul is split over threads (`MKL_CBWR`).

    With two threads the same row came out of MKL 3e-5 apart between the engine's decode and the
    learner's forward; strict mode makes them equal. MKL reads the variable when it first runs, so this
    only works before the process's first matmul; returns whether strict mode was asked for (now or by
    the environment)."""
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
    return os.environ["MKL_CBWR"].upper().endswith("STRICT")
