"""The machine a benchmark runs on: its CPU, the threads torch gets, how busy the cores were, and the
memory a process holds at its peak.

Figures from a shared machine mean little without the load they were taken under, so every engine
benchmark reports `machine_info` beside its figures and warns (`busy_warnings`) when other work shared
the cores. Peak memory is Linux's high-water mark of the process's resident set (`VmHWM`), which
`reset_peak_rss` sets back to the current resident set, so a phase's peak is its own and not that of the
model loading before it. Only reads /proc and sets torch's thread count; it prints nothing.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

from tether.kernels import cpu
from tether.models.threads import available_cores, configure_threads

PROC_SELF = Path("/proc/self")
# The instruction-set extensions a reader needs to compare CPU figures across machines.
VECTOR_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "asimd",
    "sve",
)
# A 1-minute load average above the benchmark's own threads by this much means other work shared the cores.
BUSY_LOAD_MARGIN = 0.5
MIB = 1024 * 1024


def bench_threads(threads: int | None) -> int:
    """Set torch's threads to `threads`, or to the cores idle right now when None; returns the count."""
    if threads is None:
        return configure_threads()
    torch.set_num_threads(threads)
    return threads


def vector_extensions() -> list[str]:
    """The `VECTOR_FLAGS` this CPU has, as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        flags = cpu.cpu_flags(cpu.CPU_INFO.read_text())
    except OSError:
        return []
    return [flag for flag in VECTOR_FLAGS if flag in flags]


def load_average() -> float:
    """The 1-minute load average."""
    return round(os.getloadavg()[0], 2)


def machine_info(threads: int, load_start: float, load_end: float) -> dict[str, Any]:
    """What a reader needs to weigh the figures: CPU, extensions, kernels' features, cores, load, threads."""
    return {
        "cpu": cpu.cpu_model(),
        "machine": platform.machine(),
        "vector_extensions": vector_extensions(),
        "cpu_features": sorted(feature.value for feature in cpu.detected()),
        "cores": available_cores(),
        "threads": threads,
        "load_average_start": load_start,
        "load_average_end": load_end,
        "torch": torch.__version__,
    }


def busy_warnings(threads: int, loads: dict[str, float]) -> list[str]:
    """One warning for each named load average (1 minute) that says other work shared the cores."""
    return [
        f"machine busy {when}: load average {load:.2f} with {threads} benchmark thread(s) on "
        f"{available_cores()} core(s); times are slower than on an idle machine"
        for when, load in loads.items()
        if load > threads + BUSY_LOAD_MARGIN or load > available_cores()
    ]


def _status_mib(field: str) -> float:
    """A `kB` field of /proc/self/status in MiB (0 where /proc cannot be read)."""
    try:
        text = (PROC_SELF / "status").read_text()
    except OSError:
        return 0.0
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024 / MIB
    return 0.0


def rss_mib() -> float:
    """This process's resident set now."""
    return _status_mib("VmRSS")


def peak_rss_mib() -> float:
    """This process's resident-set high-water mark since it started or since `reset_peak_rss`."""
    return _status_mib("VmHWM")


def reset_peak_rss() -> bool:
    """Set the high-water mark back to the resident set now (Linux: `5` into clear_refs); False where
    the kernel does not allow it, and `peak_rss_mib` then still counts from the process's start."""
    try:
        (PROC_SELF / "clear_refs").write_text("5")
    except OSError:
        return False
    return True
