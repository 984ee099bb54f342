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

from tether.models.governor import GovernorConfig, ThreadGovernor, Window, decide, run_delay_s

CONFIG = GovernorConfig()
BUSY = Window(wait_fraction=0.35, idle_cores=0.0)  # another process took a core: our threads waited
FREE = Window(wait_fraction=0.01, idle_cores=1.0)  # a whole core stood idle
OWN = Window(wait_fraction=0.01, idle_cores=0.1)  # busy with our own work, nobody waiting


@pytest.mark.parametrize(
    ("threads", "max_threads", "windows", "expected"),
    [
        (2, 2, [BUSY], 1),  # one waiting window is enough to give a thread up
        (1, 2, [BUSY, BUSY], 1),  # never below one
        (1, 2, [FREE], 1),  # one quiet window is no sign yet
        (1, 2, [FREE, FREE], 2),  # the core came back and stayed
        (1, 2, [BUSY, FREE], 1),  # the window before was busy: not yet
        (2, 2, [FREE, FREE], 2),  # never above the cores we may use
        (2, 2, [OWN, OWN, OWN], 2),  # busy but not waiting: our own work
        (2, 2, [Window(0.1, 0.5)] * 3, 2),  # some contention, no idle core: stay
        (4, 4, [Window(0.5, 2.0)], 3),  # waiting wins over idle cores (they are not ours to take)
        (1, 2, [Window(0.3, 1.0), Window(0.3, 1.0)], 1),  # idle cores while we wait: not ours to take
        (3, 2, [], 2),  # a count above the cores is brought down
        (0, 2, [], 1),  # and one below one up
    ],
)
def test_decide_follows_the_free_cores_of_the_last_windows(
    threads: int, max_threads: int, windows: list[Window], expected: int
) -> None:
    assert decide(threads, max_threads, windows, CONFIG) == expected


def follow(threads: int, readings: list[Window], config: GovernorConfig = CONFIG) -> list[int]:
    """The counts `decide` chooses window by window, as the governor keeps its history: the windows
    since the last change only."""
    chosen, since_change = [], []
    for window in readings:
        since_change.append(window)
        decided = decide(threads, 2, since_change, config)
        if decided != threads:
            threads, since_change = decided, []
        chosen.append(threads)
    return chosen


def test_load_that_comes_and_goes_every_window_costs_one_change() -> None:
    """Flapping input: a neighbour busy every other window. The count drops once and stays down."""
    readings = [BUSY, FREE] * 10
    chosen = follow(2, readings)
    assert chosen[0] == 1
    assert set(chosen) == {1}


def test_a_busy_start_regains_the_core_once_the_load_has_left() -> None:
    readings = [OWN] * 5 + [FREE] * 3  # started beside a busy core (1 thread), the neighbour ends at 5
    assert follow(1, readings) == [1, 1, 1, 1, 1, 1, 2, 2]


def test_without_hysteresis_the_same_input_flaps() -> None:
    """What `grow_windows` buys: at one window the alternating input changes the count every window."""
    eager = GovernorConfig(grow_windows=1)
    chosen = follow(2, [BUSY, FREE] * 5, eager)
    changes = sum(a != b for a, b in zip([2, *chosen], chosen, strict=False))
    assert changes == 10


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("window_s", 0.0),
        ("shrink_wait", 1.0),
        ("shrink_wait", 0.0),
        ("grow_idle_cores", 1.5),
        ("grow_windows", 0),
        ("shrink_windows", 1.5),
        ("grow_windows", True),
    ],
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
    assert governor.observe() == 1  # the load left: one quiet window is no sign yet
    machine.advance(2.5, delay_per_thread_s=0.0, threads=1, idle_cores=1.0)
    assert governor.observe() == 2  # it stayed away
    assert torch.get_num_threads() == 2 and governor.changes == 2


def test_a_governor_without_apply_only_keeps_the_count(restore_threads: int) -> None:
    """The async trainer splits the count between two threads itself: the governor must not set it."""
    machine = FakeMachine()
    torch.set_num_threads(1)
    governor = ThreadGovernor(
        GovernorConfig(window_s=1.0),
        max_threads=2,
        clock=lambda: machine.now,
        read_delay=lambda: machine.delay,
        read_cpu=lambda: (machine.idle, machine.total),
        cores=2,
        threads=2,
        apply=None,
    )
    machine.advance(1.5, delay_per_thread_s=0.6, threads=2, idle_cores=0)
    assert governor.observe() == 1 and governor.threads == 1 and governor.changes == 1
    for _ in range(2):
        machine.advance(1.5, delay_per_thread_s=0.0, threads=1, idle_cores=1.0)
        governor.observe()
    assert governor.threads == 2
    assert torch.get_num_threads() == 1  # the caller's own count, untouched


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
