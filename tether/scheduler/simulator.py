"""Discrete-event simulation of one policy running a job trace on a cluster model.

Events (arrival, finish, straggler check) sit in a heap; after each instant the policy plans on the
shared `SchedulingState` and the simulator applies its decisions. A running job progresses at
1 / (interconnect slowdown x straggler slowdown) work-seconds per second. The simulator models no
failures other than stragglers, no network contention between jobs and no elastic resizing.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from dataclasses import dataclass, field, fields

import numpy as np

from tether.errors import ConfigError
from tether.scheduler.cluster import ClusterState, Placement, Topology
from tether.scheduler.job import Job, JobSpec
from tether.scheduler.placement import InterconnectModel
from tether.scheduler.policy import Policy
from tether.scheduler.state import Preempt, Replace, Resize, SchedulingState, Start
from tether.scheduler.straggler import StragglerConfig, find_stragglers, mitigate

_FINISH, _CHECK, _ARRIVE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Model knobs. The straggler rate and slowdown are illustrative assumptions, not fitted to a trace:
    each replica of a multi-replica gang independently runs `straggler_slowdown` x slower (a degraded
    GPU, a throttled host) with `straggler_replica_probability` each time it is placed."""

    interconnect: InterconnectModel = field(default_factory=InterconnectModel)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    straggler_replica_probability: float = 0.005
    straggler_slowdown: float = 2.0
    mitigate_stragglers: bool = True
    step_s: float = 10.0
    step_jitter: float = 0.05
    restart_s: float = 120.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.straggler_replica_probability <= 1:
            raise ValueError(
                f"straggler_replica_probability = {self.straggler_replica_probability}: not in [0, 1]"
            )
        if self.straggler_slowdown < 1:
            raise ValueError(f"straggler_slowdown = {self.straggler_slowdown}: must be at least 1")
        if self.step_s <= 0 or self.restart_s < 0 or self.step_jitter < 0:
            raise ValueError("step_s must be positive; restart_s and step_jitter must not be negative")


@dataclass(frozen=True, slots=True)
class Timeline:
    times_s: list[float]
    busy_accelerators: list[int]
    queued_jobs: list[int]


@dataclass(frozen=True, slots=True)
class PolicyResult:
    policy: str
    jobs: int
    avg_jct_s: float
    p95_jct_s: float
    avg_queue_delay_s: float
    p95_queue_delay_s: float
    makespan_s: float
    utilization: float
    fragmentation: float
    preemptions: int
    resizes: int
    cross_domain_job_share: float
    avg_cross_domain_slowdown_s: float
    avg_straggler_slowdown_s: float
    stragglers_flagged: int
    stragglers_replaced: int
    stragglers_rescheduled: int
    wall_s: float
    timeline: Timeline

    def summary(self) -> dict[str, float | int | str]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "timeline"}


@dataclass(slots=True)
class _Run:
    """A running job's speed and the start of its current constant-speed segment."""

    interconnect: float
    straggler: float
    segment_start_s: float
    slow_replicas: dict[int, int]
    placement: Placement
    share: float = 1.0  # replicas running over the full gang (below 1 only for elastic jobs)

    @property
    def stretch(self) -> float:
        """Wall seconds per work-second."""
        return self.interconnect * self.straggler / self.share


def _added(before: Placement, after: Placement) -> tuple[tuple[int, int], ...]:
    """Replicas per node that `after` has beyond `before`."""
    old = dict(before.slots)
    return tuple((node, count - old.get(node, 0)) for node, count in after.slots if count > old.get(node, 0))


def check_feasible(jobs: list[JobSpec], topology: Topology) -> None:
    """Every job must fit the empty cluster, or a FIFO queue would wait for it forever."""
    empty = ClusterState(topology)
    shapes: dict[object, int] = {}
    for spec in jobs:
        if spec.demand not in shapes:
            shapes[spec.demand] = sum(
                empty.replicas_fitting(n, spec.demand) for n in range(len(topology.nodes))
            )
        if shapes[spec.demand] < spec.replicas:
            raise ConfigError(
                f"job {spec.job_id}: {spec.replicas} replicas of {spec.demand} cannot fit even the empty "
                f"cluster {topology.name!r} (at most {shapes[spec.demand]} fit)"
            )


class Simulation:
    def __init__(self, topology: Topology, policy: Policy, jobs: list[JobSpec], config: SimConfig) -> None:
        if not jobs:
            raise ConfigError("no jobs to simulate")
        check_feasible(jobs, topology)
        self.topology = topology
        self.policy = policy
        self.config = config
        self.state = SchedulingState(ClusterState(topology))
        self.jobs = {spec.job_id: Job(spec) for spec in jobs}
        self.rng = random.Random(config.seed)
        self.events: list[tuple[float, int, int, str, int]] = []
        self.sequence = itertools.count()
        self.epoch: dict[str, int] = {}
        self.runs: dict[str, _Run] = {}
        self.ever_spread: set[str] = set()
        self.interconnect_lost_s = 0.0
        self.straggler_lost_s = 0.0
        self.preemptions = 0
        self.flagged = self.replaced = self.rescheduled = self.resizes = 0
        for spec in jobs:
            self._push(spec.submit_s, _ARRIVE, spec.job_id)

    def run(self) -> PolicyResult:
        started = time.perf_counter()
        state = self.state
        capacity = state.cluster.capacity
        times: list[float] = []
        busy: list[int] = []
        queued: list[int] = []
        busy_integral = fragmentation_integral = 0.0
        now = self.events[0][0] if self.events else 0.0
        first_submit = now
        last_submit = max((job.spec.submit_s for job in self.jobs.values()), default=now)
        while self.events:
            instant = self.events[0][0]
            # Utilization and fragmentation are measured while jobs arrive; the final drain, set by the
            # longest job, would say more about the trace's tail than about the policy.
            span = min(instant, last_submit) - min(now, last_submit)
            busy_integral += (capacity - state.cluster.total_free) * span
            fragmentation_integral += state.cluster.fragmentation() * span
            now = instant
            while self.events and self.events[0][0] == now:
                _, kind, _, job_id, epoch = heapq.heappop(self.events)
                if kind == _ARRIVE:
                    state.submit(self.jobs[job_id])
                elif epoch == self.epoch.get(job_id):
                    if kind == _FINISH:
                        self._close_segment(job_id, now)
                        del self.runs[job_id]
                        state.finish(job_id, now)
                    else:
                        self._check_stragglers(job_id, now)
            self.policy.schedule(state, now)
            self._apply(now)
            times.append(now)
            busy.append(capacity - state.cluster.total_free)
            queued.append(len(state.queue))
        assert not state.queue and not state.running, "the event heap emptied with jobs left"
        return self._result(
            started,
            (first_submit, last_submit, now),
            busy_integral,
            fragmentation_integral,
            Timeline(times, busy, queued),
        )

    def _push(self, at: float, kind: int, job_id: str) -> None:
        heapq.heappush(self.events, (at, kind, next(self.sequence), job_id, self.epoch.get(job_id, 0)))

    def _apply(self, now: float) -> None:
        for decision in self.state.take_decisions():
            if isinstance(decision, Start):
                self._begin(decision.job_id, decision.placement, now)
            elif isinstance(decision, Preempt):
                self._stop(decision.job_id, now)
                self.preemptions += 1
            elif isinstance(decision, Resize):
                self._grow(decision.job_id, decision.placement, now)
                self.resizes += 1

    def _begin(self, job_id: str, placement: Placement, now: float) -> None:
        job = self.jobs[job_id]
        restart = self.config.restart_s if job.attempts > 1 else 0.0
        interconnect = self.config.interconnect.slowdown(placement, self.topology)
        run = _Run(interconnect, 1.0, now + restart, {}, placement, placement.replicas / job.spec.replicas)
        self.runs[job_id] = run
        self._draw_stragglers(run, placement, placement.slots)
        self._schedule_segment(job_id, run)

    def _draw_stragglers(self, run: _Run, placement: Placement, slots: tuple[tuple[int, int], ...]) -> None:
        probability = self.config.straggler_replica_probability
        if placement.replicas < 2 or probability == 0:
            return
        for node, count in slots:
            slow = sum(self.rng.random() < probability for _ in range(count))
            if slow:
                run.slow_replicas[node] = run.slow_replicas.get(node, 0) + slow
        run.straggler = self.config.straggler_slowdown if run.slow_replicas else 1.0

    def _schedule_segment(self, job_id: str, run: _Run, watch: bool = True) -> None:
        self.epoch[job_id] = self.epoch.get(job_id, 0) + 1
        rate = run.stretch
        if run.interconnect > 1.0:
            self.ever_spread.add(job_id)
        job = self.jobs[job_id]
        self._push(run.segment_start_s + job.remaining_s * rate, _FINISH, job_id)
        if watch and run.slow_replicas and self.config.mitigate_stragglers:
            # A step's time depends on placement and stragglers, not on how many replicas share it.
            step_s = self.config.step_s * run.interconnect * run.straggler
            window_s = self.config.straggler.window_steps * step_s
            if window_s < job.remaining_s * rate:
                self._push(run.segment_start_s + window_s, _CHECK, job_id)

    def _close_segment(self, job_id: str, now: float) -> None:
        """Credit the work of the segment that ends now, and account its time lost to slowdowns."""
        run = self.runs[job_id]
        job = self.jobs[job_id]
        wall = max(now - run.segment_start_s, 0.0)
        job.done_s = min(job.done_s + wall / run.stretch, job.spec.duration_s)
        self.interconnect_lost_s += wall * (1 - 1 / run.interconnect)
        self.straggler_lost_s += wall / run.interconnect * (1 - 1 / run.straggler)
        run.segment_start_s = max(now, run.segment_start_s)

    def _stop(self, job_id: str, now: float) -> None:
        self._close_segment(job_id, now)
        job = self.jobs[job_id]
        job.done_s = job.checkpointed(job.done_s)
        del self.runs[job_id]
        self.epoch[job_id] += 1

    def _grow(self, job_id: str, placement: Placement, now: float) -> None:
        """An elastic job gained replicas: it pauses to re-form its gang, then runs at the new size."""
        self._close_segment(job_id, now)
        run = self.runs[job_id]
        self._draw_stragglers(run, placement, _added(run.placement, placement))
        run.placement = placement
        run.share = placement.replicas / self.jobs[job_id].spec.replicas
        run.interconnect = self.config.interconnect.slowdown(placement, self.topology)
        run.segment_start_s = now + self.config.restart_s
        self._schedule_segment(job_id, run)

    def _check_stragglers(self, job_id: str, now: float) -> None:
        """Feed the detector a window of step times, then replace or reschedule each flagged replica."""
        run = self.runs[job_id]
        placement = self.state.running[job_id].placement
        config = self.config
        base = config.step_s * run.interconnect
        step_times: dict[tuple[int, int], list[float]] = {}
        for node, count in placement.slots:
            slow = run.slow_replicas.get(node, 0)
            for replica in range(count):
                factor = config.straggler_slowdown if replica < slow else 1.0
                step_times[(node, replica)] = [
                    base * factor * (1 + config.step_jitter * self.rng.gauss(0.0, 1.0))
                    for _ in range(config.straggler.window_steps)
                ]
        flagged: dict[int, int] = {}
        for node, _ in find_stragglers(step_times, config.straggler.threshold):
            flagged[node] = flagged.get(node, 0) + 1
        if not flagged:
            return
        self.flagged += sum(flagged.values())
        self._close_segment(job_id, now)
        job = self.jobs[job_id]
        moved = False
        for node, count in flagged.items():
            if job_id not in self.state.running:
                break
            decision = mitigate(
                self.state,
                self.policy.placer,
                job_id,
                node,
                count,
                slowdown=run.straggler,
                uncheckpointed_s=job.done_s - job.checkpointed(job.done_s),
                restart_s=config.restart_s,
            )
            if isinstance(decision, Replace):
                self.replaced += count
                self._move_replicas(run, node, count, decision.placement)
                moved = True
            elif isinstance(decision, Preempt):
                self.rescheduled += 1
                self._stop(job_id, now)
        self.state.take_decisions()
        if job_id not in self.state.running:
            return
        if moved:
            run.segment_start_s = now + config.restart_s
            run.interconnect = config.interconnect.slowdown(
                self.state.running[job_id].placement, self.topology
            )
        # A straggler kept (no spare, not worth a restart) runs slow to the end; it is not re-examined.
        self._schedule_segment(job_id, run, watch=moved)

    def _move_replicas(self, run: _Run, node: int, count: int, placement: Placement) -> None:
        run.slow_replicas[node] -= count
        if not run.slow_replicas[node]:
            del run.slow_replicas[node]
        moved_off = dict(run.placement.slots)
        moved_off[node] -= count
        # The spares are fresh draws: a spare can be slow too.
        self._draw_stragglers(
            run, placement, _added(Placement(placement.demand, tuple(moved_off.items())), placement)
        )
        run.placement = placement
        run.straggler = self.config.straggler_slowdown if run.slow_replicas else 1.0

    def _result(
        self,
        started: float,
        span: tuple[float, float, float],
        busy_integral: float,
        fragmentation_integral: float,
        timeline: Timeline,
    ) -> PolicyResult:
        jobs = list(self.jobs.values())
        jct = np.array([j.finish_s - j.spec.submit_s for j in jobs if j.finish_s is not None])
        delay = np.array([j.first_start_s - j.spec.submit_s for j in jobs if j.first_start_s is not None])
        first_submit, last_submit, end = span
        makespan = max(end - first_submit, 1e-9)
        arrival_window = max(last_submit - first_submit, 1e-9)
        return PolicyResult(
            policy=self.policy.name,
            jobs=len(jobs),
            avg_jct_s=round(float(jct.mean()), 1),
            p95_jct_s=round(float(np.percentile(jct, 95)), 1),
            avg_queue_delay_s=round(float(delay.mean()), 1),
            p95_queue_delay_s=round(float(np.percentile(delay, 95)), 1),
            makespan_s=round(makespan, 1),
            utilization=round(busy_integral / (self.state.cluster.capacity * arrival_window), 4),
            fragmentation=round(fragmentation_integral / arrival_window, 4),
            preemptions=self.preemptions,
            resizes=self.resizes,
            cross_domain_job_share=round(len(self.ever_spread) / len(jobs), 4),
            avg_cross_domain_slowdown_s=round(self.interconnect_lost_s / len(jobs), 1),
            avg_straggler_slowdown_s=round(self.straggler_lost_s / len(jobs), 1),
            stragglers_flagged=self.flagged,
            stragglers_replaced=self.replaced,
            stragglers_rescheduled=self.rescheduled,
            wall_s=round(time.perf_counter() - started, 3),
            timeline=timeline,
        )


def simulate(topology: Topology, policy: Policy, jobs: list[JobSpec], config: SimConfig) -> PolicyResult:
    return Simulation(topology, policy, jobs, config).run()
