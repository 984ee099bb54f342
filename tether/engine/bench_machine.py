"""What an engine benchmark adds to `tether.machine`'s record: the threads torch gets, the kernels'
CPU features, the vector code torch dispatches to and torch's version. Only sets torch's thread count;
it prints nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from tether.kernels import cpu
from tether.machine import machine_record
from tether.models.threads import configure_threads


def bench_threads(threads: int | None) -> int:
    """Set torch's threads to `threads`, or to the cores idle right now when None; returns the count."""
    if threads is None:
        return configure_threads()
    torch.set_num_threads(threads)
    return threads


def machine_info(threads: int, load_start: float, loads: dict[str, float] | None = None) -> dict[str, Any]:
    """`tether.machine.machine_record` and what torch uses of the CPU: the kernels' features and the
    vector extension torch's own kernels dispatch to (`torch.backends.cpu.get_cpu_capability`)."""
    return machine_record(threads, load_start, loads) | {
        "cpu_features": sorted(feature.value for feature in cpu.detected()),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }
