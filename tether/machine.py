"""The machine a benchmark runs on, read from /proc alone: the CPU's name and instruction-set flags, the
cores this process may use, how busy they are, and the memory a process holds at its peak.

Figures from a shared machine mean little without the load they were taken under. This module sits
below every subsystem (it imports nothing of tether and no torch), so the sandbox's and the gateway's
benchmarks record the same machine as the engine's. Peak memory is Linux's high-water mark of the
process's resident set (`VmHWM`), which `reset_peak_rss` sets back to the current resident set, so a
phase's peak is its own and not that of the model loading before it. It only reads; only
`warn_if_busy` writes (its warnings, to stderr).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any, TextIO

CPU_INFO = Path("/proc/cpuinfo")
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
# The vector extension families a CPU figure depends on, and the /proc/cpuinfo flag that says each is
# there: the engine's ratio over transformers was 5.7 on an AVX-512 machine and 3.98 on an AVX2-only one.
VECTOR_FAMILIES = {"AVX2": "avx2", "AVX-512": "avx512f", "AMX": "amx_tile", "NEON": "asimd", "SVE": "sve"}
# A 1-minute load average above the benchmark's own threads by this much means other work shared the cores.
BUSY_LOAD_MARGIN = 0.5
MIB = 1024 * 1024


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The instruction-set flags of the first processor listed in /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_model() -> str:
    """The CPU's name as /proc/cpuinfo gives it, or `unknown`."""
    try:
        text = CPU_INFO.read_text()
    except OSError:
        return "unknown"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return "unknown"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def vector_extensions() -> list[str]:
    """The `VECTOR_FLAGS` this CPU has, as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        flags = cpu_flags(CPU_INFO.read_text())
    except OSError:
        return []
    return [flag for flag in VECTOR_FLAGS if flag in flags]


def vector_families(flags: frozenset[str]) -> list[str]:
    """The `VECTOR_FAMILIES` among a CPU's flags, in the order of that table."""
    return [family for family, flag in VECTOR_FAMILIES.items() if flag in flags]


def load_average() -> float:
    """The 1-minute load average."""
    return round(os.getloadavg()[0], 2)


def busy_warnings(threads: int, loads: dict[str, float]) -> list[str]:
    """One warning for each named load average (1 minute) that says other work shared the cores."""
    return [
        f"machine busy {when}: load average {load:.2f} with {threads} benchmark thread(s) on "
        f"{available_cores()} core(s); times are slower than on an idle machine"
        for when, load in loads.items()
        if load > threads + BUSY_LOAD_MARGIN or load > available_cores()
    ]


def machine_record(threads: int, load_start: float, loads: dict[str, float] | None = None) -> dict[str, Any]:
    """What a reader needs to weigh a benchmark's figures, taken at its end: CPU, vector extensions, cores,
    the threads (or workers) it chose, the load average at its start, at `loads`' named points and now,
    and `busy` with the warnings that say why when other work shared the cores."""
    try:
        flags = cpu_flags(CPU_INFO.read_text())
    except OSError:
        flags = frozenset()
    load_end = load_average()
    warnings = busy_warnings(threads, {"at the start": load_start, **(loads or {}), "at the end": load_end})
    return {
        "cpu": cpu_model(),
        "machine": platform.machine(),
        "vector_extensions": vector_families(flags),
        "vector_flags": [flag for flag in VECTOR_FLAGS if flag in flags],
        "cores": available_cores(),
        "threads": threads,
        "load_average_start": load_start,
        "load_average_end": load_end,
        "busy": bool(warnings),
        "busy_warnings": warnings,
    }


def warn_if_busy(record: dict[str, Any], stream: TextIO | None = None) -> None:
    """One stderr line per busy warning of a `machine_record`, so a reader of the terminal sees it too."""
    for warning in record["busy_warnings"]:
        print(f"warning: {warning}", file=stream or sys.stderr)


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
