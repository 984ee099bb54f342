"""The C heap of a process that trains on the CPU: memory a step frees is kept for the next step.

torch's CPU tensors come from the C library's malloc. By default glibc serves each block over 32 MiB (and,
with its dynamic threshold, smaller ones) from a fresh `mmap`, and gives the top of its heap back to the
kernel once more than twice that lies free there. A training step frees nearly everything it allocated
(activations, logits, gradients), so the next step gets its memory from the kernel again, and the kernel
zeroes it one 4 KiB page fault at a time. On the 2-core development machine, SmolLM2's learner faulted
77,000 to 410,000 times in a forward of 16 samples (0.2-1.7 s of system time; the RL bench's
informative step spent 2.5 s in a forward that took 1.1 s once its pages stayed mapped), and the engine
15,328 times in every decode step at 32 streams (138 ms a step, against 101-110 ms kept).

`keep_freed_memory` turns both off (no `mmap` per block, no trimming), so a process keeps its peak heap
and reuses it, as torch's CUDA caching allocator keeps device memory. The learner and the engine ask for
it when they compute on the CPU. The cost: memory freed after a peak is not returned to the system while
the process lives, and the first steps may grow the heap past that peak (a small block can split a freed
large one, which a larger request then cannot reuse) before it settles. A trainer or a server wants that
trade; a short command does not notice it. Only glibc is asked (`mallopt`); another C library is left as
it is, and the call says so.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable

# glibc's malloc.h: the parameters of mallopt(int param, int value).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# mallopt's value is a C int: the largest trim threshold it can set, 2 GiB of free heap top.
NEVER_TRIM = 2**31 - 1

Mallopt = Callable[[int, int], int]


def glibc_mallopt() -> Mallopt | None:
    """glibc's `mallopt` in this process, or None under another C library (musl, macOS's)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    function = ctypes.CDLL(None).mallopt
    function.argtypes = (ctypes.c_int, ctypes.c_int)
    function.restype = ctypes.c_int
    mallopt: Mallopt = function
    return mallopt


def keep_freed_memory(mallopt: Mallopt | None = None) -> bool:
    """Keep freed heap memory mapped in this process for later allocations (see the module's docstring).

    Returns whether the C library took both settings: False under another C library than glibc (nothing
    is changed then). Idempotent; it affects the whole process from the next allocation on.
    """
    mallopt = mallopt if mallopt is not None else glibc_mallopt()
    if mallopt is None:
        return False
    # mallopt returns 1 on success, 0 for a value it refuses.
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1
