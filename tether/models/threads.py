"""Size torch's CPU thread pool to the cores really free: oversubscribed torch runs many times slower."""

from __future__ import annotations

import os

import torch


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def configure_threads(reserved_cores: int = 0, max_threads: int | None = None) -> int:
    """Set torch's intra-op threads to the free cores (minus `reserved_cores`); returns the count set."""
    if reserved_cores < 0:
        raise ValueError(f"reserved_cores must be >= 0, got {reserved_cores}")
    threads = max(1, available_cores() - reserved_cores)
    if max_threads is not None:
        threads = max(1, min(threads, max_threads))
    torch.set_num_threads(threads)
    return threads
