"""The local back end: tether's own jobs as processes on this machine, placed by the same policy core.

The machine is a one-node cluster (its CPUs, memory and accelerators). Every `submit`, `cancel` and
job exit runs one scheduling pass over the SQLite store: the policy decides, then this module starts a
supervisor per job (a new session, so `cancel` can kill the whole process group) or kills preempted ones.
Demands are accounted, not enforced: a job that uses more than it asked for is not throttled here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from tether.errors import ConfigError
from tether.scheduler.cluster import ClusterConfig, ClusterState, NodeGroup, Placement, Topology
from tether.scheduler.job import Demand, Job, JobSpec, JobState
from tether.scheduler.policy import Policy, get_policy
from tether.scheduler.state import Preempt, SchedulingState, Start
from tether.scheduler.store import JobRecord, JobRequest, JobStore

DEFAULT_POLICY = "fifo-backfill"
KILL_GRACE_S = 3.0


@dataclass(frozen=True, slots=True)
class MachineCapacity:
    cpus: float
    memory_mib: int
    accelerators: int = 0

    def __post_init__(self) -> None:
        if self.cpus <= 0 or self.memory_mib <= 0 or self.accelerators < 0:
            raise ValueError(f"machine capacity {self} must have CPUs and memory")

    @classmethod
    def detect(cls) -> MachineCapacity:
        memory_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
        devices = Path("/dev")
        gpus = sum(1 for p in devices.glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name))
        return cls(cpus=float(len(os.sched_getaffinity(0))), memory_mib=int(memory_mib), accelerators=gpus)


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in the group; zombies wait on their reaper."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pgid, os.WNOHANG)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if state != "Z" and int(group) == pgid:
            return True
    return False


def _kill_group(pgid: int) -> None:
    """SIGTERM the job's process group, then SIGKILL whatever is left after a grace period."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    _wait_group(pgid, KILL_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    # SIGKILL is delivered asynchronously; return once the group is really gone.
    _wait_group(pgid, KILL_GRACE_S)


def _wait_group(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


class LocalBackend:
    def __init__(
        self,
        store: JobStore,
        capacity: MachineCapacity,
        policy: Policy,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.capacity = capacity
        self.policy = policy
        self.clock = clock
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
        cls, path: Path, capacity: MachineCapacity | None = None, policy: str | None = None
    ) -> LocalBackend:
        """The store at `path`; capacity and policy are remembered in it for the job supervisors."""
        store = JobStore(path)
        stored = store.meta("capacity")
        if capacity is None:
            capacity = MachineCapacity(**json.loads(stored)) if stored else MachineCapacity.detect()
        chosen = get_policy(policy or store.meta("policy") or DEFAULT_POLICY)
        with store.transaction():
            store.set_meta("capacity", json.dumps(asdict(capacity)))
            store.set_meta("policy", chosen.name)
        return cls(store, capacity, chosen)

    def submit(self, request: JobRequest) -> JobRecord:
        self._check(request)
        with self.store.transaction():
            job_id = self.store.insert(request, self.clock())
        self.schedule()
        record = self.store.get(job_id)
        assert record is not None
        return record

    def cancel(self, job_id: int) -> JobRecord:
        with self.store.transaction():
            record = self.get(job_id)
            if record.state not in (JobState.QUEUED, JobState.RUNNING):
                raise ConfigError(
                    f"job {job_id} is already {record.state.value}; only queued or running jobs cancel"
                )
            self.store.mark_finished(job_id, JobState.CANCELLED, self.clock(), reason="cancelled by user")
        if record.pid is not None:
            _kill_group(record.pid)
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
            records = {r.id: r for r in self.store.all((JobState.QUEUED, JobState.RUNNING))}
            state = SchedulingState(ClusterState(self.topology))
            for record in records.values():
                job = Job(self._spec(record))
                state.submit(job)
                if record.state is JobState.RUNNING:
                    state.start(job, Placement(job.spec.demand, ((0, 1),)), record.started_at or now)
            state.take_decisions()
            self.policy.schedule(state, now)
            for decision in state.take_decisions():
                record = records[int(decision.job_id)]
                if isinstance(decision, Preempt) and record.pid is not None:
                    _kill_group(record.pid)
                    self.store.mark_queued(record.id, decision.reason)
                    applied.append(decision)
                elif isinstance(decision, Start):
                    self.store.mark_running(record.id, self._launch(record), now)
                    applied.append(decision)
        return applied

    def _reap(self, now: float) -> None:
        for record in self.store.all((JobState.RUNNING,)):
            if record.pid is None or not _alive(record.pid):
                self.store.mark_finished(record.id, JobState.FAILED, now, reason="its supervisor vanished")

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
        )
        return process.pid

    def _check(self, request: JobRequest) -> None:
        """Refuse what could never run here, naming the value and what this machine has."""
        if not request.command:
            raise ConfigError(
                "no command given; put it after '--', e.g. `tether jobs submit -- python train.py`"
            )
        program = request.command[0]
        found = Path(request.cwd, program) if "/" in program else shutil.which(program)
        if found is None or not os.access(found, os.X_OK) or Path(found).is_dir():
            raise ConfigError(
                f"command {program!r} is not an executable file (looked in PATH and {request.cwd})"
            )
        if request.expected_duration_s <= 0:
            raise ConfigError(f"expected duration {request.expected_duration_s} s must be positive")
        try:
            Demand(request.accelerators, request.cpus, request.memory_mib)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        for name, wanted, have in (
            ("CPUs", request.cpus, self.capacity.cpus),
            ("MiB of memory", request.memory_mib, self.capacity.memory_mib),
            ("accelerators", request.accelerators, self.capacity.accelerators),
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
            kind=request.kind,
            tenant=request.tenant,
            priority=request.priority,
            preemptible=request.preemptible,
            duration_s=request.expected_duration_s,
            submit_s=record.submitted_at,
        )
