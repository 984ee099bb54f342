"""The machine a sandbox benchmark runs on: its CPU, vector extensions, cores, and how busy they were.

The sandbox's own copy of `engine/bench_machine.py`'s figures, without torch (the sandbox may import only
`errors` and `web`, and a sandbox command must not pay for torch): the same keys, so figures from both
benches read alike. Only reads /proc; it prints nothing.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CPU_INFO = Path("/proc/cpuinfo")
# The instruction-set extensions a reader needs to compare CPU figures across machines.
VECTOR_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "amx_tile",
    "asimd",
    "sve",
)
# A 1-minute load average above the benchmark's own runnable processes by this much means other work
# shared the cores.
BUSY_LOAD_MARGIN = 0.5


def _cpuinfo() -> str:
    try:
        return CPU_INFO.read_text()
    except OSError:
        return ""


def cpu_model(cpuinfo: str) -> str:
    """The CPU's name as /proc/cpuinfo's text gives it, or `unknown`."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return "unknown"


def vector_extensions(cpuinfo: str) -> list[str]:
    """The `VECTOR_FLAGS` of the first processor in /proc/cpuinfo's text, in `VECTOR_FLAGS` order."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags = set(value.split())
            return [flag for flag in VECTOR_FLAGS if flag in flags]
    return []


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def load_average() -> float:
    """The 1-minute load average."""
    return round(os.getloadavg()[0], 2)


@dataclass(frozen=True, slots=True)
class MachineLoad:
    """The load before and after a benchmark that ran `workers` busy processes of its own."""

    workers: int
    load_start: float
    load_end: float

    def info(self) -> dict[str, Any]:
        cpuinfo = _cpuinfo()
        return {
            "cpu": cpu_model(cpuinfo),
            "machine": platform.machine(),
            "vector_extensions": vector_extensions(cpuinfo),
            "cores": available_cores(),
            "threads": self.workers,
            "load_average_start": self.load_start,
            "load_average_end": self.load_end,
        }

    def busy_warnings(self) -> list[str]:
        """One warning per load average that counts more runnable processes than the benchmark's own:
        at its start only the host process driving it, at its end also its workers."""
        own = {"at start": 1, "at end": self.workers + 1}
        loads = {"at start": self.load_start, "at end": self.load_end}
        return [
            f"machine busy {when}: load average {load:.2f} with {self.workers} benchmark worker(s) on "
            f"{available_cores()} core(s); figures are lower than on an idle machine"
            for when, load in loads.items()
            if load > own[when] + BUSY_LOAD_MARGIN
        ]
