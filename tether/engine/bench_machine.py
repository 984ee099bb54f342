"""What an engine benchmark adds to `tether.machine`'s record: the threads torch gets, the kernels'
CPU features and torch's version. Only sets torch's thread count; it prints nothing.
"""

from __future__ import annotations

import platform
from typing import Any

import torch

from tether.kernels import cpu
from tether.machine import available_cores, vector_extensions
from tether.models.threads import configure_threads


def bench_threads(threads: int | None) -> int:
    """Set torch's threads to `threads`, or to the cores idle right now when None; returns the count."""
    if threads is None:
        return configure_threads()
    torch.set_num_threads(threads)
    return threads


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
