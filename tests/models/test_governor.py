"""The thread governor: one thread fewer when ours wait for a CPU, one more when a core stands idle."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tether.models.governor import GovernorConfig, ThreadGovernor, decide, run_delay_s

CONFIG = GovernorConfig()


@pytest.mark.parametrize(
    ("threads", "wait", "idle", "expected"),
    [
        (2, 0.35, 0.0, 1),  # another process took a core: every parallel region waited for it
        (1, 0.35, 0.0, 1),  # never below one
        (1, 0.01, 1.0, 2),  # the core came back
        (2, 0.01, 1.9, 2),  # never above the cores we may use
        (2, 0.01, 0.1, 2),  # busy but not waiting: our own work
        (2, 0.1, 0.5, 2),  # some contention, no idle core: stay
        (4, 0.5, 2.0, 3),  # waiting wins over idle cores (they are not ours to take)
    ],
)
def test_decide(threads: int, wait: float, idle: float, expected: int) -> None:
    assert decide(threads, 2 if threads <= 2 else 4, wait, idle, CONFIG) == expected


@pytest.mark.parametrize(
    ("field", "value"),
    [("window_s", 0.0), ("shrink_wait", 1.0), ("shrink_wait", 0.0), ("grow_idle_cores", 1.5)],
)
def test_config_rejects_out_of_range_values(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        GovernorConfig(**{field: value})


class FakeMachine:
    """Counters a test moves by hand: our run delay, and /proc/stat's (idle, total) jiffies."""

    def __init__(self) -> None:
        self.now = 0.0
        self.delay = 0.0
        self.idle = 0
        self.total = 0

    def advance(self, seconds: float, delay_per_thread_s: float, threads: int, idle_cores: float) -> None:
        self.now += seconds
        self.delay += delay_per_thread_s * threads
        self.total += int(200 * seconds)  # 2 cores at 100 jiffies per second
        self.idle += int(100 * seconds * idle_cores)


@pytest.fixture
def restore_threads() -> Iterator[int]:
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


def test_governor_follows_load_window_by_window(restore_threads: int) -> None:
    machine = FakeMachine()
    torch.set_num_threads(2)
    governor = ThreadGovernor(
        GovernorConfig(window_s=2.0),
        max_threads=2,
        clock=lambda: machine.now,
        read_delay=lambda: machine.delay,
        read_cpu=lambda: (machine.idle, machine.total),
        cores=2,
    )
    machine.advance(1.0, delay_per_thread_s=0.5, threads=2, idle_cores=0)
    assert governor.observe() == 2  # inside the window: nothing decided yet
    machine.advance(1.5, delay_per_thread_s=0.5, threads=2, idle_cores=0)
    assert governor.observe() == 1  # 40% of the window waiting
    assert torch.get_num_threads() == 1 and governor.changes == 1
    machine.advance(2.5, delay_per_thread_s=0.0, threads=1, idle_cores=0.05)
    assert governor.observe() == 1  # still loaded: the other core is busy
    machine.advance(2.5, delay_per_thread_s=0.0, threads=1, idle_cores=1.0)
    assert governor.observe() == 2  # the load left
    assert torch.get_num_threads() == 2 and governor.changes == 2


def test_governor_without_counters_keeps_the_count(restore_threads: int) -> None:
    clock = iter(range(0, 100, 5))
    governor = ThreadGovernor(clock=lambda: next(clock), read_delay=lambda: None, read_cpu=lambda: None)
    threads = torch.get_num_threads()
    assert governor.observe() == threads and governor.observe() == threads
    assert governor.changes == 0


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux's /proc")
def test_run_delay_is_read_for_this_process() -> None:
    first = run_delay_s()
    assert first is not None and first >= 0
    second = run_delay_s()
    assert second is not None and second >= first - 0.01  # threads may end in between


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_busy_core_costs_the_engine_a_thread(restore_threads: int) -> None:
    """Real contention: a process spinning on one of our two cores makes our two threads wait, and the
    governor gives one up within a window."""
    affinity = os.sched_getaffinity(0)
    ours = set(sorted(affinity)[:2])
    busy = min(ours)
    os.sched_setaffinity(0, ours)
    torch.set_num_threads(2)
    governor = ThreadGovernor(GovernorConfig(window_s=0.5), max_threads=2)
    spinner = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{busy}}})\nwhile True: pass"]
    )
    try:
        a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
        deadline = time.monotonic() + 10
        while torch.get_num_threads() == 2 and time.monotonic() < deadline:
            for _ in range(20):
                a @ b
            governor.observe()
    finally:
        spinner.kill()
        spinner.wait()
        os.sched_setaffinity(0, affinity)
    assert torch.get_num_threads() == 1
