"""Jobs as the scheduler sees them: what a job asks for, and the mutable record of how far it got.

A job is a gang of identical replicas; each replica needs accelerators, CPUs and memory on one node.
Nothing here knows how a job is launched or where it runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum


class JobKind(Enum):
    PRETRAIN = "pretrain"
    RL = "rl"
    EVAL = "eval"
    SANDBOX = "sandbox"
    AGENT = "agent"
    SERVE = "serve"


class JobState(Enum):
    QUEUED = "queued"
    RUNNING = "running"
    # Asked to stop for a preemption (a train job checkpointing); it holds its devices until it exits.
    PREEMPTING = "preempting"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class Demand:
    """What one replica needs on its node."""

    accelerators: int = 0
    cpus: float = 1.0
    memory_mib: int = 1024
    # CPUs in thousandths, so that capacity sums stay exact.
    cpu_milli: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.accelerators < 0 or self.cpus < 0 or self.memory_mib < 0:
            raise ValueError(
                f"demand (accelerators={self.accelerators}, cpus={self.cpus}, "
                f"memory_mib={self.memory_mib}) must not be negative"
            )
        if self.accelerators == 0 and self.cpus == 0:
            raise ValueError("a replica must ask for at least one accelerator or some CPU")
        object.__setattr__(self, "cpu_milli", round(self.cpus * 1000))


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A job as submitted. `duration_s` is its work at full size and speed on a compact placement.

    An elastic job (`min_replicas` set) may start with as few as `min_replicas` replicas and grow later;
    its work rate is taken to scale linearly with its replicas.
    """

    job_id: str
    demand: Demand
    replicas: int = 1
    kind: JobKind = JobKind.AGENT
    tenant: str = "default"
    priority: int = 0
    preemptible: bool = True
    duration_s: float = 3600.0
    checkpoint_interval_s: float = 1800.0
    submit_s: float = 0.0
    min_replicas: int | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"job {self.job_id}: replicas = {self.replicas}, must be at least 1")
        if self.min_replicas is not None and not 1 <= self.min_replicas <= self.replicas:
            raise ValueError(
                f"job {self.job_id}: min_replicas = {self.min_replicas}, "
                f"must be in [1, replicas = {self.replicas}]"
            )
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ValueError(f"job {self.job_id}: duration_s = {self.duration_s}, must be positive")
        if self.checkpoint_interval_s <= 0:
            raise ValueError(f"job {self.job_id}: checkpoint_interval_s must be positive")

    @property
    def accelerators(self) -> int:
        """Accelerators of the whole gang."""
        return self.demand.accelerators * self.replicas

    @property
    def smallest(self) -> int:
        """The fewest replicas the job can run with."""
        return self.replicas if self.min_replicas is None else self.min_replicas


@dataclass(slots=True)
class Job:
    """A job and its progress. `done_s` is work done so far; a preemption rolls it back to a checkpoint."""

    spec: JobSpec
    state: JobState = JobState.QUEUED
    done_s: float = 0.0
    attempts: int = 0
    first_start_s: float | None = None
    finish_s: float | None = None

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def remaining_s(self) -> float:
        return max(self.spec.duration_s - self.done_s, 0.0)

    def checkpointed(self, done_s: float) -> float:
        """Work kept after a stop at `done_s`: everything up to the last checkpoint."""
        interval = self.spec.checkpoint_interval_s
        return min(math.floor(done_s / interval) * interval, self.spec.duration_s)
