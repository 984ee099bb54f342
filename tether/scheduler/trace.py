"""Job traces: a synthetic generator shaped after published GPU-cluster studies, and trace files.

The generator draws every job's shape, then sets the arrival rate so that the offered load
(accelerator-seconds submitted per second over capacity) is `load`; it knows nothing about any policy.
Each job is a gang of one-accelerator replicas (one worker per GPU, as in data-parallel training), so a
placer may split it across nodes. Parameters (default, then source):

- gang size in accelerators 1 / 2 / 4 / 8 / 16 / 32 / 64: 60 / 10 / 12 / 11 / 4 / 2 / 1 % of GPU jobs.
  Philly: most jobs use one GPU, few more than 8 (Jeon et al., ATC'19, §3); Helios: over half of GPU
  jobs are single-GPU while large jobs hold most GPU time (Hu et al., SC'21, §3); PAI: most tasks ask
  for at most one GPU (Weng et al., NSDI'22, §3).
- run time at full speed: lognormal, median 20 min for one accelerator, sigma 1.6 (p99 about 14 h),
  capped at 7 days. Heavy-tailed run times from minutes to days in all three traces (Philly Fig. 2,
  Helios §3.2, PAI §3).
- run time grows with gang size: median x (1 + 0.5 log2 accelerators). Larger jobs run longer in
  Philly and Helios (Jeon et al. Fig. 2; Hu et al. §3.2).
- arrivals: Poisson batches whose rate swings +/-50 % over each 24 h; a batch is 1 + geometric jobs
  (mean 2.5) of one shape. Philly and Helios show diurnal submission; Helios and PAI report bursts of
  near-identical jobs such as hyper-parameter sweeps (Hu et al. §3.1; Weng et al. §3).
- offered load: 0.9 of accelerator capacity. A busy shared cluster; Philly and Helios report long
  queueing when demand nears capacity.
- CPU and host memory per accelerator: 4 / 8 / 12 cores; 32 / 64 / 128 / 256 GiB (25/45/25/5 %).
  PAI: CPU and memory requests vary widely per GPU, and CPUs can bottleneck (Weng et al. §4).
- tenants: 16 with Zipf(1.1) popularity. Philly's 14 virtual clusters and Helios's VCs have skewed use.
- CPU-only jobs (sandbox pools): 10 % of jobs, 16 / 32 / 64 cores. tether's own mix, no trace source.
- checkpoint interval: 30 min. Common practice; it bounds the work a preemption loses.

The shares and medians are approximate readings of the papers' figures, recalled rather than re-fitted to
the released traces; they set the shape (many small short jobs, few large long ones) that scheduling
results depend on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tether.errors import ConfigError, describe_validation_error
from tether.scheduler.job import Demand, JobKind, JobSpec

GANG_SIZES = (1, 2, 4, 8, 16, 32, 64)
GANG_SHARES = (0.60, 0.10, 0.12, 0.11, 0.04, 0.02, 0.01)
CPUS_PER_ACCELERATOR = (4.0, 8.0, 12.0)
MEMORY_GIB_PER_ACCELERATOR = (32, 64, 128, 256)
MEMORY_GIB_SHARES = (0.25, 0.45, 0.25, 0.05)
SANDBOX_CPUS = (16.0, 32.0, 64.0)
DAY_S = 86_400.0
# Priority and preemptibility by kind: long pretraining runs outrank and are never preempted; evals,
# agents and sandbox pools yield to them.
KIND_PRIORITY = {
    JobKind.PRETRAIN: (2, False),
    JobKind.RL: (1, True),
    JobKind.EVAL: (0, True),
    JobKind.AGENT: (0, True),
    JobKind.SANDBOX: (0, True),
}


@dataclass(frozen=True, slots=True)
class SyntheticTrace:
    jobs: int = 10_000
    seed: int = 0
    load: float = 0.9
    cluster_accelerators: int = 1024
    median_duration_s: float = 1200.0
    duration_sigma: float = 1.6
    max_duration_s: float = 7 * DAY_S
    mean_batch: float = 2.5
    tenants: int = 16
    cpu_only_share: float = 0.10
    checkpoint_interval_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.jobs < 1:
            raise ValueError(f"synthetic trace of {self.jobs} jobs: need at least 1")
        if not 0 < self.load <= 4:
            raise ValueError(f"load = {self.load}: must be in (0, 4]")
        if self.cluster_accelerators < 1:
            raise ValueError("the cluster needs at least one accelerator for a synthetic GPU trace")
        if self.mean_batch < 1:
            raise ValueError(f"mean_batch = {self.mean_batch}: must be at least 1")

    def generate(self) -> list[JobSpec]:
        rng = np.random.default_rng(self.seed)
        count = self.jobs
        largest = max(s for s in GANG_SIZES if s <= self.cluster_accelerators)
        sizes_allowed = [s for s in GANG_SIZES if s <= largest]
        shares = np.array(GANG_SHARES[: len(sizes_allowed)])
        # Jobs come in batches of one shape (a sweep): draw batch boundaries first.
        batch_of = np.cumsum(rng.random(count) < 1.0 / self.mean_batch)
        batches = int(batch_of[-1]) + 1
        gang = rng.choice(sizes_allowed, size=batches, p=shares / shares.sum())[batch_of]
        cpu_only = (rng.random(batches) < self.cpu_only_share)[batch_of]
        median = self.median_duration_s * (1 + 0.5 * np.log2(gang))
        duration = np.minimum(median * rng.lognormal(0.0, self.duration_sigma, count), self.max_duration_s)
        duration = np.maximum(duration, 30.0)
        cpus = rng.choice(CPUS_PER_ACCELERATOR, size=batches)[batch_of]
        memory_gib = rng.choice(MEMORY_GIB_PER_ACCELERATOR, size=batches, p=MEMORY_GIB_SHARES)[batch_of]
        sandbox_cpus = rng.choice(SANDBOX_CPUS, size=batches)[batch_of]
        popularity = 1.0 / np.arange(1, self.tenants + 1) ** 1.1
        tenant = rng.choice(self.tenants, size=batches, p=popularity / popularity.sum())[batch_of]
        kind_draw = rng.random(batches)[batch_of]
        work = float(np.sum(np.where(cpu_only, 0, gang) * duration))
        # Batches per second such that submitted accelerator-seconds per second = load x capacity.
        rate_per_s = self.load * self.cluster_accelerators * batches / work
        arrivals = self._arrival_times(rng, batches, rate_per_s)[batch_of]
        jobs = []
        for i in range(count):
            kind = self._kind(int(gang[i]), bool(cpu_only[i]), float(kind_draw[i]))
            priority, preemptible = KIND_PRIORITY[kind]
            if cpu_only[i]:
                demand, replicas = Demand(0, float(sandbox_cpus[i]), 64 * 1024), 1
            else:
                demand = Demand(1, float(cpus[i]), int(memory_gib[i]) * 1024)
                replicas = int(gang[i])
            jobs.append(
                JobSpec(
                    job_id=f"j{i:06d}",
                    demand=demand,
                    replicas=replicas,
                    kind=kind,
                    tenant=f"tenant-{int(tenant[i]):02d}",
                    priority=priority,
                    preemptible=preemptible,
                    duration_s=round(float(duration[i]), 1),
                    checkpoint_interval_s=self.checkpoint_interval_s,
                    submit_s=round(float(arrivals[i]), 3),
                )
            )
        return jobs

    def _arrival_times(
        self, rng: np.random.Generator, batches: int, rate_per_s: float
    ) -> np.ndarray[Any, np.dtype[np.float64]]:
        """Poisson batch arrivals with a rate that swings +/-50% over each day, by thinning."""
        peak = 1.5 * rate_per_s
        times: list[float] = []
        t = 0.0
        while len(times) < batches:
            for gap, u in zip(rng.exponential(1.0 / peak, batches), rng.random(batches), strict=True):
                t += float(gap)
                if u * 1.5 <= 1.0 + 0.5 * math.sin(2 * math.pi * t / DAY_S):
                    times.append(t)
                    if len(times) == batches:
                        break
        return np.array(times)

    @staticmethod
    def _kind(gang: int, cpu_only: bool, draw: float) -> JobKind:
        if cpu_only:
            return JobKind.SANDBOX
        if gang >= 8:
            return JobKind.PRETRAIN if draw < 0.6 else JobKind.RL
        if gang >= 2:
            return JobKind.RL if draw < 0.5 else JobKind.EVAL
        return JobKind.EVAL if draw < 0.6 else JobKind.AGENT


class TraceJob(BaseModel):
    """One job of a trace file; the per-replica fields describe one replica of the gang."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str = Field(min_length=1)
    submit_s: float = Field(ge=0, description="Arrival time in seconds from the trace start.")
    duration_s: float = Field(gt=0, description="Run time at full speed on a compact placement.")
    replicas: int = Field(1, ge=1, le=100_000, description="Gang size.")
    min_replicas: int | None = Field(
        None, ge=1, description="Set for an elastic job: the fewest it runs with."
    )
    accelerators: int = Field(0, ge=0, le=256, description="Accelerators per replica.")
    cpus: float = Field(1.0, ge=0, le=4096, description="CPU cores per replica.")
    memory_mib: int = Field(1024, ge=0, description="Host memory per replica in MiB.")
    kind: JobKind = JobKind.AGENT
    tenant: str = "default"
    priority: int = 0
    preemptible: bool = True
    checkpoint_interval_s: float = Field(1800.0, gt=0)

    def spec(self) -> JobSpec:
        try:
            return self._spec()
        except ValueError as error:
            message = str(error)
            raise ConfigError(
                message if message.startswith("job ") else f"job {self.job_id}: {message}"
            ) from None

    def _spec(self) -> JobSpec:
        return JobSpec(
            job_id=self.job_id,
            demand=Demand(self.accelerators, self.cpus, self.memory_mib),
            replicas=self.replicas,
            kind=self.kind,
            tenant=self.tenant,
            priority=self.priority,
            preemptible=self.preemptible,
            duration_s=self.duration_s,
            checkpoint_interval_s=self.checkpoint_interval_s,
            submit_s=self.submit_s,
            min_replicas=self.min_replicas,
        )

    @classmethod
    def from_spec(cls, spec: JobSpec) -> TraceJob:
        return cls(
            job_id=spec.job_id,
            submit_s=spec.submit_s,
            duration_s=spec.duration_s,
            replicas=spec.replicas,
            accelerators=spec.demand.accelerators,
            cpus=spec.demand.cpus,
            memory_mib=spec.demand.memory_mib,
            kind=spec.kind,
            tenant=spec.tenant,
            priority=spec.priority,
            preemptible=spec.preemptible,
            checkpoint_interval_s=spec.checkpoint_interval_s,
            min_replicas=spec.min_replicas,
        )


def load_trace(path: Path) -> list[JobSpec]:
    """Jobs from a JSON file (a list, or an object with a `jobs` list) or JSON Lines (`.jsonl`)."""
    if not path.is_file():
        raise ConfigError(f"trace file {str(path)!r} does not exist")
    text = path.read_text()
    source = f"trace file {str(path)!r}"
    try:
        if path.suffix.lower() == ".jsonl":
            rows: Any = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            rows = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{source} is not valid JSON: {error}") from None
    if isinstance(rows, dict):
        rows = rows.get("jobs")
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"{source} must hold a non-empty list of jobs (or an object with a 'jobs' list)")
    specs = []
    for number, row in enumerate(rows, 1):
        try:
            specs.append(TraceJob.model_validate(row).spec())
        except ValidationError as error:
            raise ConfigError(describe_validation_error(error, f"{source} job #{number}", TraceJob)) from None
    seen: set[str] = set()
    for spec in specs:
        if spec.job_id in seen:
            raise ConfigError(f"{source}: job_id {spec.job_id!r} appears more than once")
        seen.add(spec.job_id)
    return sorted(specs, key=lambda spec: spec.submit_s)


def save_trace(jobs: list[JobSpec], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (TraceJob.from_spec(spec).model_dump_json() for spec in jobs)
    path.write_text("\n".join(lines) + "\n")
