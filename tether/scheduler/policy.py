"""Scheduling policies: a registry of named (queue order, placement, backfill, preemption) compositions.

`schedule(state, now)` walks the queue in the policy's order and starts, preempts or leaves each job,
recording decisions in the `SchedulingState`. Without backfill the first job that cannot start blocks
everyone behind it (head-of-line blocking is what FIFO means). With backfill (EASY, as in Slurm and
Maui) a later job may jump ahead only if it cannot delay the blocked job's reserved start.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from tether.errors import ConfigError
from tether.scheduler.cluster import Placement
from tether.scheduler.job import Job
from tether.scheduler.placement import FirstFit, Placer, TopologyAware
from tether.scheduler.state import Allocation, SchedulingState

# How many queued jobs one pass considers, like Slurm's bf_max_job_test: it bounds a pass's cost when
# thousands of jobs wait.
DEFAULT_DEPTH = 256

Order = Callable[[SchedulingState, int], Iterable[Job]]


class Policy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def placer(self) -> Placer: ...

    def schedule(self, state: SchedulingState, now: float) -> None: ...


def submit_order(state: SchedulingState, depth: int) -> Iterable[Job]:
    return state.queue.in_submit_order(depth)


def priority_order(state: SchedulingState, depth: int) -> Iterable[Job]:
    jobs = state.queue.by_priority(depth)
    return [job for _, job in zip(range(depth), jobs, strict=False)]


def fair_share_order(state: SchedulingState, depth: int) -> Iterator[Job]:
    """Next job of the tenant using the fewest accelerators now, re-read after every start (equal weights)."""
    pending = {tenant: state.queue.of_tenant(tenant, depth) for tenant in state.queue.tenants()}
    cursors = dict.fromkeys(pending, 0)
    usage = state.tenant_accelerators
    for _ in range(depth):
        open_tenants = [t for t in pending if cursors[t] < len(pending[t])]
        if not open_tenants:
            return
        tenant = min(open_tenants, key=lambda t: (usage.get(t, 0), t))
        cursors[tenant] += 1
        yield pending[tenant][cursors[tenant] - 1]


@dataclass(slots=True)
class _Reservation:
    """EASY backfill: the blocked job's expected start and the accelerators it leaves spare then."""

    shadow_s: float
    spare: int

    @classmethod
    def for_blocked(cls, state: SchedulingState, job: Job, now: float) -> _Reservation:
        need = job.spec.accelerators
        free = state.cluster.total_free
        if free >= need:  # blocked by shape (CPU, memory, spread) rather than count: start it next
            return cls(now, free - need)
        for end_s, accelerators in sorted(
            (a.expected_end_s, a.placement.accelerators) for a in state.running.values()
        ):
            free += accelerators
            if free >= need:
                return cls(max(end_s, now), free - need)
        return cls(math.inf, 0)

    def admits(self, job: Job, now: float) -> bool:
        return now + job.remaining_s <= self.shadow_s or job.spec.accelerators <= self.spare

    def consume(self, job: Job, now: float) -> None:
        if now + job.remaining_s > self.shadow_s:
            self.spare -= job.spec.accelerators


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    name: str
    description: str
    order: Order
    placer: Placer
    backfill: bool = False
    preemption: bool = False
    depth: int = DEFAULT_DEPTH

    def schedule(self, state: SchedulingState, now: float) -> None:
        reservation: _Reservation | None = None
        cluster = state.cluster
        for job in self.order(state, self.depth):
            if reservation is not None and not reservation.admits(job, now):
                continue
            spec = job.spec
            placement = None
            if spec.smallest * spec.demand.accelerators <= cluster.total_free:
                placement = self._place(state, job)
            if placement is None and self.preemption:
                placement = self._preempt_for(state, job)
            if placement is not None:
                state.start(job, placement, now)
                if reservation is not None:
                    reservation.consume(job, now)
                continue
            if not self.backfill:
                return
            if reservation is None:
                reservation = _Reservation.for_blocked(state, job, now)
        if not len(state.queue):
            self._grow(state)

    def _place(self, state: SchedulingState, job: Job) -> Placement | None:
        """The whole gang, or for an elastic job as many replicas as fit, down to its minimum."""
        spec = job.spec
        placement = self.placer.place(state.cluster, spec.demand, spec.replicas)
        if placement is None and spec.min_replicas is not None:
            placement = self._largest(state, job, spec.min_replicas, spec.replicas - 1)
        return placement

    def _largest(self, state: SchedulingState, job: Job, low: int, high: int) -> Placement | None:
        """Binary search for the most replicas in [low, high] that fit now (fewer always fit if more do)."""
        best = None
        while low <= high:
            middle = (low + high) // 2
            placement = self.placer.place(state.cluster, job.spec.demand, middle)
            if placement is None:
                high = middle - 1
            else:
                best, low = placement, middle + 1
        return best

    def _grow(self, state: SchedulingState) -> None:
        """With nobody waiting, elastic jobs that started short take the free capacity, oldest first."""
        for job_id in list(state.growable):
            allocation = state.running[job_id]
            spec = allocation.job.spec
            if spec.demand.accelerators > state.cluster.total_free:
                continue
            extra = self._largest(state, allocation.job, 1, spec.replicas - allocation.placement.replicas)
            if extra is not None:
                state.resize(job_id, allocation.placement.plus(extra))

    def _preempt_for(self, state: SchedulingState, job: Job) -> Placement | None:
        """Free room for `job` by stopping lower-priority preemptible jobs, newest first; None if it can't."""
        priority = job.spec.priority
        victims: list[Allocation] = sorted(
            (a for a in state.running.values() if a.job.spec.preemptible and a.job.spec.priority < priority),
            key=lambda a: (a.job.spec.priority, -a.started_s),
        )
        freed = state.cluster.total_free
        chosen: list[Allocation] = []
        for victim in victims:
            if freed >= job.spec.accelerators and chosen:
                break
            chosen.append(victim)
            freed += victim.placement.accelerators
        if not chosen or freed < job.spec.accelerators:
            return None
        for victim in chosen:
            state.cluster.release(victim.placement)
        placement = self.placer.place(state.cluster, job.spec.demand, job.spec.replicas)
        for victim in chosen:
            state.cluster.allocate(victim.placement)
        if placement is None:
            return None
        used = set(placement.nodes)
        for victim in chosen:
            # Only victims on the nodes the new gang uses must go; the others keep running.
            if used.intersection(victim.placement.nodes):
                state.preempt(victim.job.job_id, f"preempted by {job.job_id} (priority {priority})")
        return placement


POLICIES: dict[str, Policy] = {
    policy.name: policy
    for policy in (
        QueuePolicy(
            "fifo", "arrival order, head-of-line blocking, first-fit placement", submit_order, FirstFit()
        ),
        QueuePolicy(
            "fifo-backfill",
            "arrival order with EASY backfill, first-fit",
            submit_order,
            FirstFit(),
            backfill=True,
        ),
        QueuePolicy(
            "priority",
            "strict priority; preempts lower-priority preemptible jobs, first-fit",
            priority_order,
            FirstFit(),
            preemption=True,
        ),
        QueuePolicy(
            "fair-share",
            "least-served tenant first with EASY backfill, first-fit",
            fair_share_order,
            FirstFit(),
            backfill=True,
        ),
        QueuePolicy(
            "topology",
            "arrival order with EASY backfill; packs gangs into the smallest interconnect domain",
            submit_order,
            TopologyAware(),
            backfill=True,
        ),
    )
}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}") from None


def parse_policies(names: str) -> list[Policy]:
    """`fifo,topology` to policies, in order, each once."""
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    if not wanted:
        raise ConfigError(f"--policy {names!r}: name at least one of {', '.join(POLICIES)}")
    return [get_policy(name) for name in dict.fromkeys(wanted)]
