"""The torch threads of a training run, following the free cores (`tether.models.governor`) as it runs.

Sync mode generates and learns on one thread: the governor sets that thread's count before each step of
an in-process engine and at each phase of a training step. Async mode generates and learns at once on two
threads (`pipeline.py`), and oversubscribed cores stall every parallel region (`tether/models/threads.py`),
so each thread takes its share of the governor's count when its phase starts: the split follows the count.
Torch's count is per thread, so this module only ever sets the calling thread's. Without a governor
(`run.adapt_threads = false`) the count at the start holds for the whole run.
"""

from __future__ import annotations

from enum import Enum

import torch

from tether.models.governor import GovernorConfig, ThreadGovernor


class ThreadRole(Enum):
    ROLLOUT = "rollout"
    LEARNER = "learner"


def split_threads(threads: int) -> tuple[int, int]:
    """(rollout, learner) torch threads for async mode out of `threads`: learning is the longer half of
    a step."""
    rollout = max(1, threads // 2)
    return rollout, max(1, threads - rollout)


class TrainingThreads:
    """The run's torch thread count in all (`total`) and each phase's share of it."""

    def __init__(self, threads: int, split: bool, governor: ThreadGovernor | None) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.start = threads
        self.split = split
        """Async mode: rollout and learner threads share the count."""
        self.governor = governor

    @classmethod
    def for_run(cls, adapt: bool, split: bool, window_s: float = 2.0) -> TrainingThreads:
        """From the calling thread's count now; `adapt`: a governor moves it with the free cores, deciding
        every `window_s` at most (in sync mode it sets the count itself, so an engine stepping on this
        thread can consult it too)."""
        threads = torch.get_num_threads()
        governor = None
        if adapt:
            apply = None if split else torch.set_num_threads
            governor = ThreadGovernor(GovernorConfig(window_s=window_s), threads=threads, apply=apply)
        return cls(threads, split, governor)

    @property
    def total(self) -> int:
        """The count chosen now, over both threads in async mode."""
        return self.governor.threads if self.governor is not None else self.start

    @property
    def changes(self) -> int:
        return self.governor.changes if self.governor is not None else 0

    @property
    def decisions(self) -> int:
        """Windows of load the governor has weighed so far (0 without one)."""
        return self.governor.decisions if self.governor is not None else 0

    def share(self, role: ThreadRole) -> int:
        """The count a thread in `role` runs with out of `total`."""
        if not self.split:
            return self.total
        rollout, learner = split_threads(self.total)
        return rollout if role is ThreadRole.ROLLOUT else learner

    def take(self, role: ThreadRole) -> int:
        """At a phase boundary on the thread of `role`: re-decide the count, set this thread's share of
        it and return that share."""
        if self.governor is not None:
            self.governor.observe()
        share = self.share(role)
        if torch.get_num_threads() != share:
            torch.set_num_threads(share)
        return share

    def metrics(self, rollout_threads: int, learner_threads: int) -> dict[str, float]:
        """A step's thread counts, as `metrics.jsonl` records them (all under `run/threads`: they follow
        the machine's load, so two runs of one config may differ there and nowhere else)."""
        return {
            "run/threads": float(self.total),
            "run/threads_rollout": float(rollout_threads),
            "run/threads_learner": float(learner_threads),
            "run/threads_changes": float(self.changes),
        }
