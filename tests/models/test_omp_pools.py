"""A passing thread takes its OpenMP pool with it: the process's thread count is back where it was, while
the same parallel op in the main thread leaves a worker behind. Results and errors reach the caller."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tether.models.omp_pools import in_passing_thread

# The pool's workers exit after the thread that owned it has been joined, a moment later: the count is
# read once it settles (or after 5 s), so a pool that stays shows and one on its way out does not.
COUNT_THREADS = """
import os, time, torch
from tether.models.omp_pools import in_passing_thread
torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
def settled(target):
    deadline = time.monotonic() + 5
    while threads() != target and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()
big = torch.randn(1 << 21)
before = threads()
assert in_passing_thread(lambda: float(big.exp().sum())) > 0
after_passing = settled(before)
big.exp()  # the same parallel op in the main thread
print(before, after_passing, settled(before + 1))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_a_passing_thread_leaves_no_openmp_pool_where_the_main_thread_leaves_one() -> None:
    out = subprocess.run([sys.executable, "-c", COUNT_THREADS], capture_output=True, text=True, check=True)
    before, after_passing, after_main = (int(n) for n in out.stdout.split())
    assert after_passing == before
    assert after_main == before + 1  # the main thread's pool: one worker beside it


def test_the_work_result_and_its_error_reach_the_caller() -> None:
    assert in_passing_thread(lambda: 42) == 42
    error = KeyError("missing")

    def fail() -> None:
        raise error

    with pytest.raises(KeyError) as raised:
        in_passing_thread(fail)
    assert raised.value is error
