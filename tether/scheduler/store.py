"""The local back end's persistent job store: one SQLite file shared by every `tether jobs` process.

Writers take `BEGIN IMMEDIATE` so that two submitters, or a submitter and a finishing job's supervisor,
never both hand out the same capacity. The store holds records only; it starts and kills nothing.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tether.config import state_home
from tether.errors import ConfigError
from tether.scheduler.job import JobKind, JobState
from tether.scheduler.workload import WorkloadKind

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    command TEXT NOT NULL,
    cwd TEXT NOT NULL,
    kind TEXT NOT NULL,
    tenant TEXT NOT NULL,
    priority INTEGER NOT NULL,
    preemptible INTEGER NOT NULL,
    cpus REAL NOT NULL,
    memory_mib INTEGER NOT NULL,
    accelerators INTEGER NOT NULL,
    expected_duration_s REAL NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    submitted_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    pid INTEGER,
    exit_code INTEGER,
    reason TEXT NOT NULL DEFAULT '',
    log_path TEXT NOT NULL
);
"""

# Columns added after the first release; a store created before them gains them on open.
_ADDED_COLUMNS = {
    "workload": "TEXT NOT NULL DEFAULT 'command'",
    "replicas": "INTEGER NOT NULL DEFAULT 1",
    "run_dir": "TEXT NOT NULL DEFAULT ''",
    "stop_grace_s": "REAL NOT NULL DEFAULT 120",
    "max_restarts": "INTEGER NOT NULL DEFAULT 3",
    "devices": "TEXT NOT NULL DEFAULT '[]'",
    "ports": "TEXT NOT NULL DEFAULT '[]'",
    "child_pgid": "INTEGER",
    "preemptions": "INTEGER NOT NULL DEFAULT 0",
    "resumes": "INTEGER NOT NULL DEFAULT 0",
    "restarts": "INTEGER NOT NULL DEFAULT 0",
}


def default_store_path() -> Path:
    """`jobs.sqlite` in the state directory (`$TETHER_HOME`, see `tether.config.state_home`)."""
    return state_home() / "jobs.sqlite"


@dataclass(frozen=True, slots=True)
class JobRequest:
    """What `tether jobs submit` asks for: `replicas` processes on this machine, each with the demand.

    `run_dir` is a train job's run directory (where its checkpoints are); `stop_grace_s` is how long a
    SIGTERM'd job may take to stop (finish a step and checkpoint) before SIGKILL; `max_restarts` bounds
    how often a service workload is restarted after a failure.
    """

    command: tuple[str, ...]
    name: str = ""
    cwd: str = "."
    kind: JobKind = JobKind.AGENT
    tenant: str = "default"
    priority: int = 0
    preemptible: bool = False
    cpus: float = 1.0
    memory_mib: int = 512
    accelerators: int = 0
    expected_duration_s: float = 3600.0
    workload: WorkloadKind = WorkloadKind.COMMAND
    replicas: int = 1
    run_dir: str = ""
    stop_grace_s: float = 120.0
    max_restarts: int = 3


@dataclass(frozen=True, slots=True)
class JobRecord:
    id: int
    request: JobRequest
    state: JobState
    attempts: int
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    pid: int | None
    exit_code: int | None
    reason: str
    log_path: str
    devices: tuple[int, ...] = ()
    ports: tuple[int, ...] = ()
    child_pgid: int | None = None
    preemptions: int = 0
    resumes: int = 0
    restarts: int = 0

    def summary(self) -> dict[str, object]:
        request = self.request
        return {
            "id": self.id,
            "name": request.name,
            "command": list(request.command),
            "cwd": request.cwd,
            "kind": request.kind.value,
            "tenant": request.tenant,
            "priority": request.priority,
            "preemptible": request.preemptible,
            "cpus": request.cpus,
            "memory_mib": request.memory_mib,
            "accelerators": request.accelerators,
            "expected_duration_s": request.expected_duration_s,
            "workload": request.workload.value,
            "replicas": request.replicas,
            "run_dir": request.run_dir,
            "stop_grace_s": request.stop_grace_s,
            "max_restarts": request.max_restarts,
            "state": self.state.value,
            "devices": list(self.devices),
            "ports": list(self.ports),
            "attempts": self.attempts,
            "preemptions": self.preemptions,
            "resumes": self.resumes,
            "restarts": self.restarts,
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "pid": self.pid,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "log_path": self.log_path,
        }


def _record(row: sqlite3.Row) -> JobRecord:
    request = JobRequest(
        command=tuple(json.loads(row["command"])),
        name=row["name"],
        cwd=row["cwd"],
        kind=JobKind(row["kind"]),
        tenant=row["tenant"],
        priority=row["priority"],
        preemptible=bool(row["preemptible"]),
        cpus=row["cpus"],
        memory_mib=row["memory_mib"],
        accelerators=row["accelerators"],
        expected_duration_s=row["expected_duration_s"],
        workload=WorkloadKind(row["workload"]),
        replicas=row["replicas"],
        run_dir=row["run_dir"],
        stop_grace_s=row["stop_grace_s"],
        max_restarts=row["max_restarts"],
    )
    return JobRecord(
        id=row["id"],
        request=request,
        state=JobState(row["state"]),
        attempts=row["attempts"],
        submitted_at=row["submitted_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        pid=row["pid"],
        exit_code=row["exit_code"],
        reason=row["reason"],
        log_path=row["log_path"],
        devices=tuple(json.loads(row["devices"])),
        ports=tuple(json.loads(row["ports"])),
        child_pgid=row["child_pgid"],
        preemptions=row["preemptions"],
        resumes=row["resumes"],
        restarts=row["restarts"],
    )


class JobStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, timeout=30.0, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
            present = {row["name"] for row in self._db.execute("PRAGMA table_info(jobs)")}
            for column, definition in _ADDED_COLUMNS.items():
                if column not in present:
                    self._db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {definition}")
        except (OSError, sqlite3.DatabaseError) as error:
            raise ConfigError(f"job store {str(path)!r} cannot be opened: {error}") from None
        self.log_dir = path.parent / f"{path.stem}-logs"

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row["value"])

    def set_meta(self, key: str, value: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def insert(self, request: JobRequest, now: float) -> int:
        cursor = self._db.execute(
            "INSERT INTO jobs (name, command, cwd, kind, tenant, priority, preemptible, cpus, memory_mib,"
            " accelerators, expected_duration_s, state, submitted_at, workload, replicas, run_dir,"
            " stop_grace_s, max_restarts, log_path)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, '')",
            (
                request.name,
                json.dumps(list(request.command)),
                request.cwd,
                request.kind.value,
                request.tenant,
                request.priority,
                int(request.preemptible),
                request.cpus,
                request.memory_mib,
                request.accelerators,
                request.expected_duration_s,
                JobState.QUEUED.value,
                now,
                request.workload.value,
                request.replicas,
                request.run_dir,
                request.stop_grace_s,
                request.max_restarts,
            ),
        )
        job_id = cursor.lastrowid
        assert job_id is not None
        self._db.execute(
            "UPDATE jobs SET log_path = ? WHERE id = ?", (str(self.log_dir / f"job-{job_id}.log"), job_id)
        )
        return job_id

    def get(self, job_id: int) -> JobRecord | None:
        row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _record(row)

    def all(self, states: tuple[JobState, ...] = ()) -> list[JobRecord]:
        if not states:
            rows = self._db.execute("SELECT * FROM jobs ORDER BY id").fetchall()
        else:
            marks = ", ".join("?" for _ in states)
            rows = self._db.execute(
                f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY id", [s.value for s in states]
            ).fetchall()
        return [_record(row) for row in rows]

    def mark_running(
        self,
        job_id: int,
        pid: int,
        now: float,
        devices: tuple[int, ...] = (),
        ports: tuple[int, ...] = (),
        resume: bool = False,
    ) -> None:
        self._db.execute(
            "UPDATE jobs SET state = ?, pid = ?, child_pgid = NULL, started_at = ?, attempts = attempts + 1,"
            " resumes = resumes + ?, devices = ?, ports = ?, reason = '' WHERE id = ?",
            (JobState.RUNNING.value, pid, now, int(resume), json.dumps(devices), json.dumps(ports), job_id),
        )

    def set_child(self, job_id: int, pgid: int | None) -> None:
        """The process group of the job's own processes (the supervisor's children)."""
        self._db.execute("UPDATE jobs SET child_pgid = ? WHERE id = ?", (pgid, job_id))

    def mark_preempting(self, job_id: int, reason: str) -> None:
        """Asked to stop; it keeps its devices until its supervisor sees it exit."""
        self._db.execute(
            "UPDATE jobs SET state = ?, reason = ? WHERE id = ?", (JobState.PREEMPTING.value, reason, job_id)
        )

    def mark_queued(self, job_id: int, reason: str, preempted: bool = True) -> None:
        self._db.execute(
            "UPDATE jobs SET state = ?, pid = NULL, child_pgid = NULL, devices = '[]', ports = '[]',"
            " preemptions = preemptions + ?, reason = ? WHERE id = ?",
            (JobState.QUEUED.value, int(preempted), reason, job_id),
        )

    def note_restart(self, job_id: int, reason: str) -> None:
        self._db.execute("UPDATE jobs SET restarts = restarts + 1, reason = ? WHERE id = ?", (reason, job_id))

    def mark_finished(
        self, job_id: int, state: JobState, now: float, exit_code: int | None = None, reason: str = ""
    ) -> None:
        self._db.execute(
            "UPDATE jobs SET state = ?, finished_at = ?, exit_code = ?, reason = ?, devices = '[]',"
            " ports = '[]' WHERE id = ?",
            (state.value, now, exit_code, reason, job_id),
        )
