"""A training run's torch threads: the governor's count, split between rollout and learner threads."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from tether.models.governor import GovernorConfig, ThreadGovernor
from tether.rl.cores import ThreadRole, TrainingThreads, split_threads


@pytest.fixture
def restore_threads() -> Iterator[int]:
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


class Load:
    """Counters a test moves by hand: our run delay and /proc/stat's (idle, total) jiffies of 2 cores."""

    def __init__(self) -> None:
        self.now, self.delay, self.idle, self.total = 0.0, 0.0, 0, 0

    def window(self, wait_s: float, idle_cores: float) -> None:
        self.now += 1.0
        self.delay += wait_s
        self.total += 200
        self.idle += int(100 * idle_cores)

    def governor(self, threads: int, split: bool) -> ThreadGovernor:
        return ThreadGovernor(
            GovernorConfig(window_s=1.0),
            max_threads=4,
            clock=lambda: self.now,
            read_delay=lambda: self.delay,
            read_cpu=lambda: (self.idle, self.total),
            cores=4,
            threads=threads,
            apply=None if split else torch.set_num_threads,
        )


@pytest.mark.parametrize(("threads", "split"), [(1, (1, 1)), (2, (1, 1)), (3, (1, 2)), (4, (2, 2))])
def test_split_gives_the_learner_the_larger_half(threads: int, split: tuple[int, int]) -> None:
    assert split_threads(threads) == split


def test_async_shares_follow_the_governors_count(restore_threads: int) -> None:
    load = Load()
    threads = TrainingThreads(4, split=True, governor=load.governor(4, split=True))
    assert threads.take(ThreadRole.LEARNER) == 2 and torch.get_num_threads() == 2
    load.window(wait_s=2.0, idle_cores=0.0)  # our 4 threads waited half the window: a core was taken
    assert threads.take(ThreadRole.LEARNER) == 2  # 3 in all: the learner keeps the larger half
    assert threads.total == 3
    seen: list[int] = []
    rollout = threading.Thread(target=lambda: seen.extend([threads.take(ThreadRole.ROLLOUT)]))
    rollout.start()
    rollout.join()
    assert seen == [1]
    assert torch.get_num_threads() == 2  # the rollout thread set only its own count
    assert threads.metrics(1, 2) == {
        "run/threads": 3.0,
        "run/threads_rollout": 1.0,
        "run/threads_learner": 2.0,
        "run/threads_changes": 1.0,
    }


def test_sync_runs_every_phase_on_the_governors_count(restore_threads: int) -> None:
    load = Load()
    torch.set_num_threads(1)
    threads = TrainingThreads(1, split=False, governor=load.governor(1, split=False))
    for _ in range(2):
        load.window(wait_s=0.0, idle_cores=2.0)
        threads.take(ThreadRole.ROLLOUT)
    assert threads.total == 2 and torch.get_num_threads() == 2
    assert threads.take(ThreadRole.LEARNER) == 2


def test_without_a_governor_the_starting_count_holds(restore_threads: int) -> None:
    threads = TrainingThreads(3, split=True, governor=None)
    assert (threads.take(ThreadRole.ROLLOUT), threads.take(ThreadRole.LEARNER)) == (1, 2)
    assert threads.total == 3 and threads.changes == 0


def test_a_run_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="threads must be at least 1, got 0"):
        TrainingThreads(0, split=False, governor=None)
