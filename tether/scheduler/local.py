"""The local back end: tether's own jobs as processes on this machine, placed by the same policy core.

The machine is a one-node cluster (its CPUs, memory and accelerators, the accelerators grouped in
NVLink islands). Every `submit`, `cancel` and job exit runs one scheduling pass over the SQLite store:
the policy decides, then this module gives each started job concrete accelerator indices (best-fit
island, recorded in the store) and starts its supervisor, or asks a preempted job's supervisor to stop
it. A preempted job keeps its devices until it has stopped (a train job: finished its step and
checkpointed), so the job that preempted it starts on the pass that follows. CPU and memory demands
are accounted, not enforced; devices are enforced through `CUDA_VISIBLE_DEVICES`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tether.errors import ConfigError
from tether.scheduler.cluster import ClusterConfig, ClusterState, NodeGroup, Placement, Topology
from tether.scheduler.devices import Islands, assign_devices, detect_islands, one_island
from tether.scheduler.job import Demand, Job, JobSpec, JobState
from tether.scheduler.policy import Policy, get_policy
from tether.scheduler.processes import alive, free_ports, kill_group, signal_group, wait_group
from tether.scheduler.state import Decision, Preempt, SchedulingState, Start
from tether.scheduler.store import JobRecord, JobRequest, JobStore
from tether.scheduler.straggler import StragglerConfig, mitigate
from tether.scheduler.workload import WORKLOADS, check_workload, has_checkpoint

DEFAULT_POLICY = "fifo-backfill"
# How long a cancelled job may take to exit on SIGTERM before SIGKILL (a preemption uses the job's own
# `stop_grace_s`, long enough for a step and a checkpoint).
KILL_GRACE_S = 3.0
_LIVE = (JobState.RUNNING, JobState.PREEMPTING)


@dataclass(frozen=True, slots=True)
class MachineCapacity:
    """What this machine offers; `islands` groups accelerator indices by NVLink (default: one island)."""

    cpus: float
    memory_mib: int
    accelerators: int = 0
    islands: Islands = ()

    def __post_init__(self) -> None:
        if self.cpus <= 0 or self.memory_mib <= 0 or self.accelerators < 0:
            raise ValueError(f"machine capacity {self} must have CPUs and memory")
        islands = tuple(tuple(int(d) for d in island) for island in self.islands) or one_island(
            self.accelerators
        )
        if sorted(d for island in islands for d in island) != list(range(self.accelerators)):
            raise ValueError(
                f"islands {islands} must hold each accelerator index 0..{self.accelerators - 1} once"
            )
        object.__setattr__(self, "islands", islands)

    @classmethod
    def detect(cls) -> MachineCapacity:
        """CPUs, memory, `/dev/nvidia<N>` devices, and their NVLink islands from `nvidia-smi topo -m`."""
        memory_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
        gpus = sum(1 for p in Path("/dev").glob("nvidia*") if p.name.removeprefix("nvidia").isdigit())
        return cls(
            cpus=float(len(os.sched_getaffinity(0))),
            memory_mib=int(memory_mib),
            accelerators=gpus,
            islands=detect_islands(gpus),
        )

    def with_accelerators(self, count: int) -> MachineCapacity:
        """This machine told to offer `count` accelerators (one island unless the count is unchanged)."""
        if count < 0:
            raise ConfigError(f"accelerators = {count}: must be 0 or more")
        if count == self.accelerators:
            return self
        return replace(self, accelerators=count, islands=())


def _block_sigterm() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _resumes(request: JobRequest) -> bool:
    """A resumable job whose run directory holds a checkpoint continues from it."""
    workload = WORKLOADS[request.workload]
    return workload.resumable and has_checkpoint(str(Path(request.cwd, request.run_dir)))


def replica_commands(record: JobRecord) -> list[tuple[str, ...]]:
    """What the supervisor runs for this attempt: a resumed train job gets `--resume RUN_DIR`."""
    request = record.request
    workload = WORKLOADS[request.workload]
    return workload.replica_commands(
        request.command, request.replicas, record.ports, request.run_dir, _resumes(request)
    )


class LocalBackend:
    def __init__(
        self,
        store: JobStore,
        capacity: MachineCapacity,
        policy: Policy,
        clock: Callable[[], float] = time.time,
        stragglers: StragglerConfig | None = None,
    ) -> None:
        self.store = store
        self.capacity = capacity
        self.policy = policy
        self.clock = clock
        self.stragglers = stragglers or StragglerConfig()
        node = NodeGroup(
            name="local",
            count=1,
            accelerators=capacity.accelerators,
            cpus=capacity.cpus,
            memory_gib=capacity.memory_mib / 1024,
        )
        self.topology = Topology.from_config(ClusterConfig(name="local", node_groups=[node]))

    @classmethod
    def open(
        cls,
        path: Path,
        capacity: MachineCapacity | None = None,
        policy: str | None = None,
        accelerators: int | None = None,
        stragglers: StragglerConfig | None = None,
    ) -> LocalBackend:
        """The store at `path`; capacity, policy and straggler settings are remembered in it for the job
        supervisors. `accelerators` overrides how many accelerators this machine offers (detected
        otherwise), and is remembered too.
        """
        store = JobStore(path.resolve())  # supervisors start in the job's directory, not ours
        stored = store.meta("capacity")
        if capacity is None:
            capacity = MachineCapacity(**json.loads(stored)) if stored else MachineCapacity.detect()
        if accelerators is not None:
            capacity = capacity.with_accelerators(accelerators)
        chosen = get_policy(policy or store.meta("policy") or DEFAULT_POLICY)
        if stragglers is None:
            stored_stragglers = store.meta("stragglers")
            stragglers = (
                StragglerConfig(**json.loads(stored_stragglers)) if stored_stragglers else StragglerConfig()
            )
        with store.transaction():
            store.set_meta("capacity", json.dumps(asdict(capacity)))
            store.set_meta("policy", chosen.name)
            store.set_meta("stragglers", json.dumps(asdict(stragglers)))
        return cls(store, capacity, chosen, stragglers=stragglers)

    def submit(self, request: JobRequest) -> JobRecord:
        self._check(request)
        with self.store.transaction():
            job_id = self.store.insert(request, self.clock())
        self.schedule()
        return self.get(job_id)

    def cancel(self, job_id: int) -> JobRecord:
        with self.store.transaction():
            record = self.get(job_id)
            if record.state not in (JobState.QUEUED, *_LIVE):
                raise ConfigError(
                    f"job {job_id} is already {record.state.value}; only queued or running jobs cancel"
                )
            self.store.mark_finished(job_id, JobState.CANCELLED, self.clock(), reason="cancelled by user")
        if record.pid is not None:
            self._stop_now(record)
        self.schedule()
        return self.get(job_id)

    def get(self, job_id: int) -> JobRecord:
        record = self.store.get(job_id)
        if record is None:
            raise ConfigError(f"no job with id {job_id} in {str(self.store.path)!r}")
        return record

    def schedule(self) -> list[Start | Preempt]:
        """One pass: reap vanished jobs, let the policy decide, then start and preempt processes."""
        now = self.clock()
        applied: list[Start | Preempt] = []
        with self.store.transaction():
            self._reap(now)
            live = self.store.all((JobState.QUEUED, *_LIVE))
            records = {r.id: r for r in live}
            held = {d for r in live if r.state in _LIVE for d in r.devices}
            # A job being preempted is on its way out: the policy plans with its capacity free (so it
            # does not pick a second victim), but what takes its place starts once it has really gone.
            state = self._model((r for r in live if r.state is not JobState.PREEMPTING), now)
            occupied = ClusterState(self.topology)
            for r in live:
                if r.state in _LIVE:
                    occupied.allocate(self._placement(r))
            state.take_decisions()
            self.policy.schedule(state, now)
            for decision in state.take_decisions():
                record = records[int(decision.job_id)]
                if isinstance(decision, Preempt) and record.state is JobState.RUNNING:
                    self._preempt(record, decision.reason)
                    applied.append(decision)
                elif isinstance(decision, Start):
                    request = record.request
                    placement = self._placement(record)
                    devices = assign_devices(
                        self.capacity.islands, held, request.accelerators * request.replicas
                    )
                    if devices is None or occupied.replicas_fitting(0, placement.demand) < request.replicas:
                        continue
                    held.update(devices)
                    occupied.allocate(placement)
                    self._start(record, devices, now)
                    applied.append(decision)
        return applied

    def straggler_decision(self, job_id: int, replicas: int, slowdown: float) -> Decision | None:
        """What the straggler mitigation does about `replicas` slow replicas of a running job (pure).

        This machine is one node, so there is never a spare node to move them to: the job is requeued
        when running slow would cost more than the work since it started plus a restart, else kept.
        """
        record = self.get(job_id)
        now = self.clock()
        state = self._model([record], now)
        state.take_decisions()
        uncheckpointed_s = now - (record.started_at or now)
        return mitigate(
            state,
            self.policy.placer,
            str(job_id),
            0,
            replicas,
            slowdown=slowdown,
            uncheckpointed_s=uncheckpointed_s,
            restart_s=self.stragglers.restart_s,
        )

    def _model(self, records: Iterable[JobRecord], now: float) -> SchedulingState:
        state = SchedulingState(ClusterState(self.topology))
        for record in records:
            job = Job(self._spec(record))
            state.submit(job)
            if record.state is JobState.RUNNING:
                started = record.started_at or now
                job.done_s = min(now - started, job.spec.duration_s)
                state.start(job, self._placement(record), started)
        return state

    def _placement(self, record: JobRecord) -> Placement:
        request = record.request
        return Placement(
            Demand(request.accelerators, request.cpus, request.memory_mib), ((0, request.replicas),)
        )

    def _preempt(self, record: JobRecord, reason: str) -> None:
        """Ask the job's supervisor to stop it (SIGTERM to its processes, SIGKILL after its grace)."""
        self.store.mark_preempting(record.id, reason)
        if record.pid is not None:
            signal_group(record.pid, signal.SIGTERM)

    def _stop_now(self, record: JobRecord) -> None:
        """Stop a cancelled job: its supervisor gives it `KILL_GRACE_S`, then we kill what is left."""
        assert record.pid is not None
        signal_group(record.pid, signal.SIGTERM)
        if not wait_group(record.pid, 2 * KILL_GRACE_S + 1):
            signal_group(record.pid, signal.SIGKILL)
        current = self.get(record.id)
        if current.child_pgid is not None:
            kill_group(current.child_pgid, KILL_GRACE_S)

    def _reap(self, now: float) -> None:
        for record in self.store.all(_LIVE):
            if record.pid is None or not alive(record.pid):
                if record.child_pgid is not None:  # nobody will checkpoint an orphan: kill it
                    signal_group(record.child_pgid, signal.SIGKILL)
                if record.state is JobState.PREEMPTING:  # it was stopping anyway: requeue it
                    self.store.mark_queued(record.id, record.reason)
                else:
                    self.store.mark_finished(
                        record.id, JobState.FAILED, now, reason="its supervisor vanished"
                    )

    def _start(self, record: JobRecord, devices: tuple[int, ...], now: float) -> None:
        workload = WORKLOADS[record.request.workload]
        ports = free_ports(record.request.replicas) if workload.port_per_replica else ()
        resume = _resumes(record.request)
        self.store.mark_running(record.id, self._launch(record), now, devices, ports, resume)

    def _launch(self, record: JobRecord) -> int:
        log = Path(record.log_path)
        log.parent.mkdir(parents=True, exist_ok=True)
        process = subprocess.Popen(
            [sys.executable, "-m", "tether.scheduler.supervisor", str(self.store.path), str(record.id)],
            cwd=record.request.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            # SIGTERM waits (blocked, pending) until the supervisor has its handler: a stop asked for
            # while it starts up is not lost, and does not kill it before it can record anything.
            preexec_fn=_block_sigterm,
        )
        return process.pid

    def _check(self, request: JobRequest) -> None:
        """Refuse what could never run here, naming the value and what this machine has."""
        if not request.command:
            raise ConfigError(
                "no command given; put it after '--', e.g. `tether jobs submit -- python train.py`"
            )
        workload = WORKLOADS[request.workload]
        check_workload(workload, request.command, request.replicas)
        if not workload.subcommand:  # a tether workload runs in this interpreter, whatever PATH holds
            program = request.command[0]
            found = Path(request.cwd, program) if "/" in program else shutil.which(program)
            if found is None or not os.access(found, os.X_OK) or Path(found).is_dir():
                raise ConfigError(
                    f"command {program!r} is not an executable file (looked in PATH and {request.cwd})"
                )
        if workload.resumable and not request.run_dir:
            raise ConfigError(f"the {workload.kind.value} workload needs its run directory to resume from")
        if request.replicas < 1:
            raise ConfigError(f"replicas = {request.replicas}: must be at least 1")
        if request.expected_duration_s <= 0:
            raise ConfigError(f"expected duration {request.expected_duration_s} s must be positive")
        if request.stop_grace_s <= 0:
            raise ConfigError(f"stop grace {request.stop_grace_s} s must be positive")
        if request.max_restarts < 0:
            raise ConfigError(f"max restarts {request.max_restarts} must be 0 or more")
        try:
            Demand(request.accelerators, request.cpus, request.memory_mib)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        replicas = request.replicas
        for name, wanted, have in (
            ("CPUs", request.cpus * replicas, self.capacity.cpus),
            ("MiB of memory", request.memory_mib * replicas, self.capacity.memory_mib),
            ("accelerators", request.accelerators * replicas, self.capacity.accelerators),
        ):
            if wanted > have:
                raise ConfigError(
                    f"the job asks for {wanted:g} {name} but this machine has {have:g}; it could never start"
                )

    @staticmethod
    def _spec(record: JobRecord) -> JobSpec:
        request = record.request
        return JobSpec(
            job_id=str(record.id),
            demand=Demand(request.accelerators, request.cpus, request.memory_mib),
            replicas=request.replicas,
            kind=request.kind,
            tenant=request.tenant,
            priority=request.priority,
            preemptible=request.preemptible,
            duration_s=request.expected_duration_s,
            submit_s=record.submitted_at,
        )
