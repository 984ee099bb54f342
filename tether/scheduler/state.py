"""What a policy reads and changes: the queue, the running allocations and the cluster's free capacity.

`SchedulingState` keeps them consistent (a started job leaves the queue and takes its capacity; a
preempted job gives it back and rejoins the queue) and records every change as a decision, which the
back end (simulator, local machine, Ray) then carries out. It does no I/O and reads no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.scheduler.cluster import ClusterState, Placement
from tether.scheduler.job import Job, JobState
from tether.scheduler.queue import JobQueue


@dataclass(frozen=True, slots=True)
class Start:
    job_id: str
    placement: Placement


@dataclass(frozen=True, slots=True)
class Preempt:
    """Stop the job; it rejoins the queue and resumes from its last checkpoint."""

    job_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Replace:
    """Move slow replicas off `node`; the job's whole placement becomes `placement`."""

    job_id: str
    node: int
    placement: Placement


@dataclass(frozen=True, slots=True)
class Resize:
    """Grow an elastic job that started short of its full size; `placement` is its whole new placement."""

    job_id: str
    placement: Placement


Decision = Start | Preempt | Replace | Resize


@dataclass(slots=True)
class Allocation:
    job: Job
    placement: Placement
    started_s: float
    expected_end_s: float


class SchedulingState:
    def __init__(self, cluster: ClusterState) -> None:
        self.cluster = cluster
        self.queue = JobQueue()
        self.running: dict[str, Allocation] = {}
        self.tenant_accelerators: dict[str, int] = {}
        # Elastic jobs running short of their full size, in start order: candidates to grow.
        self.growable: dict[str, None] = {}
        self.decisions: list[Decision] = []

    def submit(self, job: Job) -> None:
        job.state = JobState.QUEUED
        self.queue.push(job)

    def start(self, job: Job, placement: Placement, now: float) -> None:
        assert job.spec.smallest <= placement.replicas <= job.spec.replicas, (
            "a gang starts whole or not at all"
        )
        self.queue.remove(job)
        self._take(job, placement, now)
        job.state = JobState.RUNNING
        job.attempts += 1
        if job.first_start_s is None:
            job.first_start_s = now
        self.decisions.append(Start(job.job_id, placement))

    def preempt(self, job_id: str, reason: str) -> Allocation:
        allocation = self._give_back(job_id)
        self.submit(allocation.job)
        self.decisions.append(Preempt(job_id, reason))
        return allocation

    def replace(self, job_id: str, node: int, placement: Placement) -> None:
        """Swap a running job's placement for one that avoids `node` (already chosen by the caller)."""
        assert placement.replicas == self.running[job_id].placement.replicas, (
            "a replacement keeps the gang whole"
        )
        self._swap(job_id, placement)
        self.decisions.append(Replace(job_id, node, placement))

    def resize(self, job_id: str, placement: Placement) -> None:
        allocation = self.running[job_id]
        assert allocation.placement.replicas < placement.replicas <= allocation.job.spec.replicas
        self._swap(job_id, placement)
        if placement.replicas == allocation.job.spec.replicas:
            del self.growable[job_id]
        self.decisions.append(Resize(job_id, placement))

    def finish(self, job_id: str, now: float, state: JobState = JobState.DONE) -> Job:
        job = self._give_back(job_id).job
        job.state = state
        job.finish_s = now
        return job

    def cancel_queued(self, job: Job, now: float) -> None:
        self.queue.remove(job)
        job.state = JobState.CANCELLED
        job.finish_s = now

    def take_decisions(self) -> list[Decision]:
        decisions, self.decisions = self.decisions, []
        return decisions

    def _take(self, job: Job, placement: Placement, now: float) -> None:
        self.cluster.allocate(placement)
        tenant = job.spec.tenant
        self.tenant_accelerators[tenant] = self.tenant_accelerators.get(tenant, 0) + placement.accelerators
        self.running[job.job_id] = Allocation(job, placement, now, now + job.remaining_s)
        if placement.replicas < job.spec.replicas:
            self.growable[job.job_id] = None

    def _swap(self, job_id: str, placement: Placement) -> None:
        allocation = self.running[job_id]
        self.cluster.release(allocation.placement)
        self.cluster.allocate(placement)
        tenant = allocation.job.spec.tenant
        self.tenant_accelerators[tenant] += placement.accelerators - allocation.placement.accelerators
        allocation.placement = placement

    def _give_back(self, job_id: str) -> Allocation:
        allocation = self.running.pop(job_id)
        self.growable.pop(job_id, None)
        self.cluster.release(allocation.placement)
        self.tenant_accelerators[allocation.job.spec.tenant] -= allocation.placement.accelerators
        return allocation
