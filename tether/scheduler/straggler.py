"""Straggler detection and mitigation for synchronous gangs, where the slowest replica sets every step.

Workers report step times; a replica whose median step over the window exceeds `threshold` times the
median of its peers is flagged. Mitigation moves the slow replicas to spare capacity on another node, or, when
there is none, requeues the job if running slow would cost more than the work lost since its checkpoint.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from tether.scheduler.cluster import Placement
from tether.scheduler.placement import Placer
from tether.scheduler.state import Decision, SchedulingState

Replica = TypeVar("Replica", bound=Hashable)


@dataclass(frozen=True, slots=True)
class StragglerConfig:
    threshold: float = 1.5
    window_steps: int = 20
    restart_s: float = 120.0

    def __post_init__(self) -> None:
        if self.threshold <= 1.0:
            raise ValueError(
                f"straggler threshold = {self.threshold}: must be above 1 (a multiple of the median)"
            )
        if self.window_steps < 1:
            raise ValueError(f"straggler window_steps = {self.window_steps}: must be at least 1")


def find_stragglers(step_times: Mapping[Replica, Sequence[float]], threshold: float) -> list[Replica]:
    """Replicas whose median step time exceeds `threshold` x the median of the other replicas' medians."""
    medians = {replica: statistics.median(times) for replica, times in step_times.items() if times}
    if len(medians) < 2:
        return []
    ordered = sorted(medians.values())
    flagged = []
    for replica, own in medians.items():
        peers = list(ordered)
        del peers[bisect.bisect_left(peers, own)]
        if own > threshold * statistics.median(peers):
            flagged.append(replica)
    return flagged


@dataclass(slots=True)
class StragglerDetector:
    """Sliding windows of reported step times per (job, replica)."""

    config: StragglerConfig = field(default_factory=StragglerConfig)
    _windows: dict[str, dict[int, deque[float]]] = field(default_factory=dict)

    def report(self, job_id: str, replica: int, step_s: float) -> None:
        if not step_s > 0:
            raise ValueError(f"job {job_id} replica {replica}: step time {step_s} must be positive")
        replicas = self._windows.setdefault(job_id, {})
        replicas.setdefault(replica, deque(maxlen=self.config.window_steps)).append(step_s)

    def stragglers(self, job_id: str) -> list[int]:
        """Flagged replicas, once every replica has filled its window."""
        windows = self._windows.get(job_id, {})
        if any(len(w) < self.config.window_steps for w in windows.values()):
            return []
        return sorted(find_stragglers(windows, self.config.threshold))

    def forget(self, job_id: str) -> None:
        self._windows.pop(job_id, None)


def mitigate(
    state: SchedulingState,
    placer: Placer,
    job_id: str,
    node: int,
    replicas: int,
    *,
    slowdown: float,
    uncheckpointed_s: float,
    restart_s: float,
) -> Decision | None:
    """Move `replicas` slow replicas off `node` to a spare, else requeue if cheaper; None: keep running.

    The requeue test weighs the slow remainder against the work since the checkpoint plus a restart;
    it does not know how long the job will then wait in the queue.
    """
    allocation = state.running[job_id]
    slots = dict(allocation.placement.slots)
    assert 0 < replicas <= slots[node], "moving replicas the node does not hold"
    slots[node] -= replicas
    if not slots[node]:
        del slots[node]
    demand = allocation.placement.demand
    spare = placer.place(state.cluster, demand, replicas, exclude=frozenset({node}))
    if spare is not None:
        for spare_node, count in spare.slots:
            slots[spare_node] = slots.get(spare_node, 0) + count
        state.replace(job_id, node, Placement(demand, tuple(sorted(slots.items()))))
        return state.decisions[-1]
    remaining_s = allocation.job.remaining_s
    if remaining_s * (slowdown - 1.0) > uncheckpointed_s + restart_s:
        state.preempt(job_id, f"straggler on node {node}: rescheduled")
        return state.decisions[-1]
    return None
