"""The agent journal: tasks, steps and tool calls in SQLite (embedded default, WAL) or PostgreSQL.

Append-only and write-once: a step row is inserted once per `(task_id, step_no)` (a second insert returns
the first), tool-call rows are inserted as intents with their step, and the later writes only fill
columns that were empty (an observation, a commit time, a snapshot key), guarded by `IS NULL`. Writes
for a task are fenced by its lease epoch, so a worker that lost its lease (it stalled and another worker
took the task over) cannot write anything more. The journal knows nothing of models, tools or queues.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from tether.errors import ConfigError, TetherError
from tether.store.database import READ_ONLY, journal_tables, make_engine, sqlite_path
from tether.store.records import (
    JsonDict,
    StepRecord,
    StepStatus,
    StepUsage,
    TaskRecord,
    TaskStatus,
    ToolCallRecord,
)


class UnknownTask(TetherError, LookupError):
    """No task with this id is in the journal."""


class LeaseLost(TetherError):
    """Another worker holds the task now; this worker must stop writing and acting for it."""


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


class Journal:
    def __init__(
        self, url: str, table_prefix: str = "agent_", clock: Callable[[], float] = time.time
    ) -> None:
        if not table_prefix.replace("_", "").isalnum():
            raise ConfigError(f"table prefix {table_prefix!r}: use letters, digits and underscores only")
        self.url = url
        self.engine = make_engine(url)
        path = sqlite_path(url)
        if path is not None:  # SQLite creates the file, not the directories above it
            path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._meta, self.tasks, self.steps_table, self.tool_calls = journal_tables(table_prefix)
        self._meta.create_all(self.engine)
        self._prepare_hot_statements()

    def _prepare_hot_statements(self) -> None:
        """Statements of the per-step path, built once: SQLAlchemy then reuses their compiled form, which
        is most of what keeps persisting a step within a few milliseconds."""
        dialect = postgresql if self.engine.dialect.name == "postgresql" else sqlite
        t, s, c = self.tasks.c, self.steps_table.c, self.tool_calls.c
        self._fence_statement = (
            sa.update(self.tasks)
            .where(t.task_id == sa.bindparam("f_task"), t.lease_epoch == sa.bindparam("f_epoch"))
            .values(updated_at=sa.bindparam("f_now"))
        )
        # RETURNING tells whether the row was new: psycopg reports no rowcount for ON CONFLICT DO NOTHING.
        self._insert_step = dialect.insert(self.steps_table).on_conflict_do_nothing().returning(s.step_no)
        self._insert_call = dialect.insert(self.tool_calls).on_conflict_do_nothing()
        self._observe = (
            sa.update(self.tool_calls)
            .where(c.idempotency_key == sa.bindparam("o_key"), c.observation.is_(None))
            .values(observation=sa.bindparam("o_observation"), observed_at=sa.bindparam("o_at"))
        )
        self._commit = (
            sa.update(self.steps_table)
            .where(
                s.task_id == sa.bindparam("c_task"),
                s.step_no == sa.bindparam("c_step"),
                s.committed_at.is_(None),
            )
            .values(committed_at=sa.bindparam("c_at"), snapshot_key=sa.bindparam("c_snapshot"))
        )

    def close(self) -> None:
        self.engine.dispose()

    def drop_schema(self) -> None:
        """Remove this journal's tables (tests use a unique prefix and clean up after themselves)."""
        self._meta.drop_all(self.engine)

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        with self.engine.begin() as conn:
            yield conn

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            yield conn.execution_options(**{READ_ONLY: True})

    def _insert_ignoring_duplicates(self, table: sa.Table, rows: list[JsonDict], conn: Connection) -> int:
        if not rows:
            return 0
        dialect = postgresql if self.engine.dialect.name == "postgresql" else sqlite
        statement = dialect.insert(table).values(rows).on_conflict_do_nothing()
        return conn.execute(statement).rowcount

    # ---- tasks -------------------------------------------------------------------------------------

    def create_task(self, task_id: str, spec: JsonDict) -> TaskRecord:
        """Insert a queued task; submitting the same id again returns the existing task unchanged."""
        now = self._clock()
        row = {
            "task_id": task_id,
            "spec": _dumps(spec),
            "status": TaskStatus.QUEUED.value,
            "created_at": now,
            "updated_at": now,
            "lease_epoch": 0,
            "lease_expires_at": 0.0,
            "cancel_requested": False,
        }
        with self._tx() as conn:
            self._insert_ignoring_duplicates(self.tasks, [row], conn)
        return self.get_task(task_id)

    def get_task(self, task_id: str) -> TaskRecord:
        with self._read() as conn:
            row = conn.execute(sa.select(self.tasks).where(self.tasks.c.task_id == task_id)).first()
        if row is None:
            raise UnknownTask(f"no task {task_id!r} in the journal at {self.url}")
        return _task(row._mapping)

    def list_tasks(self, limit: int = 100, status: TaskStatus | None = None) -> list[TaskRecord]:
        query = sa.select(self.tasks).order_by(self.tasks.c.created_at.desc()).limit(limit)
        if status is not None:
            query = query.where(self.tasks.c.status == status.value)
        with self._read() as conn:
            return [_task(row._mapping) for row in conn.execute(query)]

    def claim(self, task_id: str, owner: str, lease_s: float) -> int | None:
        """Take the task's lease if it is free, expired or already ours; returns the new epoch or None."""
        now = self._clock()
        t = self.tasks.c
        with self._tx() as conn:
            updated = conn.execute(
                sa.update(self.tasks)
                .where(
                    t.task_id == task_id,
                    t.status.in_([TaskStatus.QUEUED.value, TaskStatus.RUNNING.value]),
                    sa.or_(t.owner.is_(None), t.lease_expires_at < now, t.owner == owner),
                )
                .values(
                    owner=owner,
                    lease_epoch=t.lease_epoch + 1,
                    lease_expires_at=now + lease_s,
                    status=TaskStatus.RUNNING.value,
                    updated_at=now,
                )
            ).rowcount
            if not updated:
                return None
            epoch = conn.execute(sa.select(t.lease_epoch).where(t.task_id == task_id)).scalar_one()
        return int(epoch)

    def _fence(self, conn: Connection, task_id: str, epoch: int, **values: Any) -> None:
        """First statement of every write for a task: fails unless `epoch` is still the task's lease.

        Being a write, it also takes the task row's lock (PostgreSQL) for the rest of the transaction."""
        t = self.tasks.c
        if values:
            statement = (
                sa.update(self.tasks)
                .where(t.task_id == task_id, t.lease_epoch == epoch)
                .values(updated_at=self._clock(), **values)
            )
            updated = conn.execute(statement).rowcount
        else:
            params = {"f_task": task_id, "f_epoch": epoch, "f_now": self._clock()}
            updated = conn.execute(self._fence_statement, params).rowcount
        if not updated:
            raise LeaseLost(f"task {task_id}: lease epoch {epoch} is no longer current")

    def renew(self, task_id: str, epoch: int, lease_s: float) -> None:
        with self._tx() as conn:
            self._fence(conn, task_id, epoch, lease_expires_at=self._clock() + lease_s)

    def release(self, task_id: str, epoch: int) -> None:
        """Give the lease up early (a hand-off, a worker stopping between steps) so another can resume at
        once; the task is queued again, as no worker is running it."""
        try:
            with self._tx() as conn:
                self._fence(
                    conn, task_id, epoch, owner=None, lease_expires_at=0.0, status=TaskStatus.QUEUED.value
                )
        except LeaseLost:
            pass

    def finish(
        self,
        task_id: str,
        epoch: int,
        status: TaskStatus,
        result: str | None = None,
        error: str | None = None,
    ) -> None:
        assert status.terminal
        with self._tx() as conn:
            self._fence(conn, task_id, epoch, status=status.value, result=result, error=error, owner=None)

    def request_cancel(self, task_id: str) -> TaskRecord:
        """Mark the task cancelled if no worker holds it, else ask its worker to stop before its next step."""
        task = self.get_task(task_id)
        if task.status.terminal:
            return task
        now = self._clock()
        t = self.tasks.c
        with self._tx() as conn:
            conn.execute(sa.update(self.tasks).where(t.task_id == task_id).values(cancel_requested=True))
            conn.execute(
                sa.update(self.tasks)
                .where(t.task_id == task_id, sa.or_(t.owner.is_(None), t.lease_expires_at < now))
                .where(t.status.in_([TaskStatus.QUEUED.value, TaskStatus.RUNNING.value]))
                .values(status=TaskStatus.CANCELLED.value, updated_at=now, lease_epoch=t.lease_epoch + 1)
            )
        return self.get_task(task_id)

    def requeue(self, task_id: str) -> TaskRecord:
        """Make a stopped task runnable again (`tether agent resume`); its steps are kept.

        An operator's resume takes the task over at once: its lease is cleared without bumping the epoch,
        so the next claim bumps it and a worker still running the task is fenced out at its next write."""
        t = self.tasks.c
        with self._tx() as conn:
            conn.execute(
                sa.update(self.tasks)
                .where(t.task_id == task_id, t.status != TaskStatus.SUCCEEDED.value)
                .values(
                    status=TaskStatus.QUEUED.value,
                    cancel_requested=False,
                    error=None,
                    owner=None,
                    lease_expires_at=0.0,
                    updated_at=self._clock(),
                )
            )
        return self.get_task(task_id)

    # ---- steps -------------------------------------------------------------------------------------

    def append_step(self, step: StepRecord) -> StepRecord:
        """Journal a step's model output and tool-call intents before any of them is acted on.

        Idempotent by `(task_id, step_no)`: if the step is already there, the stored one is returned and
        nothing is written, so a retried append can never fork the history.
        """
        step_row = {
            "task_id": step.task_id,
            "step_no": step.step_no,
            "epoch": step.epoch,
            "role": step.role,
            "message": _dumps(step.message),
            "usage": _dumps(step.usage),
            "messages_in": step.messages_in,
            "messages_in_digest": step.messages_in_digest,
            "started_at": step.started_at,
            "model_done_at": step.model_done_at,
        }
        call_rows = [
            {
                "idempotency_key": call.idempotency_key,
                "task_id": call.task_id,
                "step_no": call.step_no,
                "call_index": call.call_index,
                "tool": call.tool,
                "arguments": _dumps(call.arguments),
                "intent_at": call.intent_at,
                "executions": 0,
            }
            for call in step.tool_calls
        ]
        with self._tx() as conn:
            self._fence(conn, step.task_id, step.epoch)
            inserted = conn.execute(self._insert_step, step_row).first() is not None
            if inserted and call_rows:
                conn.execute(self._insert_call, call_rows)
        if inserted:
            return replace(step, status=StepStatus.PLANNED, committed_at=None, snapshot_key=None)
        stored = self.step(step.task_id, step.step_no)
        assert stored is not None
        return stored

    def mark_started(self, task_id: str, epoch: int, key: str) -> int:
        """Count a physical execution of a tool call before it starts; returns the count with this one."""
        c = self.tool_calls.c
        with self._tx() as conn:
            self._fence(conn, task_id, epoch)
            conn.execute(
                sa.update(self.tool_calls).where(c.idempotency_key == key).values(executions=c.executions + 1)
            )
            count = conn.execute(sa.select(c.executions).where(c.idempotency_key == key)).scalar_one()
        return int(count)

    def record_observation(self, task_id: str, epoch: int, key: str, observation: JsonDict) -> None:
        """Write a tool call's observation once; a second write for the same key changes nothing."""
        with self._tx() as conn:
            self._fence(conn, task_id, epoch)
            conn.execute(
                self._observe, {"o_key": key, "o_observation": _dumps(observation), "o_at": self._clock()}
            )

    def commit_step(
        self,
        task_id: str,
        step_no: int,
        epoch: int,
        observations: dict[str, JsonDict],
        snapshot_key: str | None,
    ) -> None:
        """Record the step's remaining observations and its checkpoint and mark it committed, atomically."""
        now = self._clock()
        with self._tx() as conn:
            self._fence(conn, task_id, epoch)
            if observations:
                conn.execute(
                    self._observe,
                    [
                        {"o_key": key, "o_observation": _dumps(obs), "o_at": now}
                        for key, obs in observations.items()
                    ],
                )
            conn.execute(
                self._commit, {"c_task": task_id, "c_step": step_no, "c_at": now, "c_snapshot": snapshot_key}
            )

    def step(self, task_id: str, step_no: int) -> StepRecord | None:
        found = [step for step in self.steps(task_id, from_step=step_no) if step.step_no == step_no]
        return found[0] if found else None

    def steps(self, task_id: str, from_step: int = 0) -> list[StepRecord]:
        s = self.steps_table.c
        c = self.tool_calls.c
        with self._read() as conn:
            step_rows = conn.execute(
                sa.select(self.steps_table)
                .where(s.task_id == task_id, s.step_no >= from_step)
                .order_by(s.step_no)
            ).all()
            call_rows = conn.execute(
                sa.select(self.tool_calls)
                .where(c.task_id == task_id, c.step_no >= from_step)
                .order_by(c.step_no, c.call_index)
            ).all()
        calls: dict[int, list[ToolCallRecord]] = {}
        for row in call_rows:
            call = _tool_call(row._mapping)
            calls.setdefault(call.step_no, []).append(call)
        return [
            replace(_step(row._mapping), tool_calls=tuple(calls.get(row.step_no, []))) for row in step_rows
        ]

    def step_usage(self, task_ids: Sequence[str]) -> dict[str, list[StepUsage]]:
        """The steps of these tasks as their usage and start time, in one query (a list of tasks with their
        step counts and tokens reads this instead of every task's replies and tool calls)."""
        s = self.steps_table.c
        found: dict[str, list[StepUsage]] = {task_id: [] for task_id in task_ids}
        if not task_ids:
            return found
        query = (
            sa.select(s.task_id, s.step_no, s.usage, s.started_at)
            .where(s.task_id.in_(list(task_ids)))
            .order_by(s.task_id, s.step_no)
        )
        with self._read() as conn:
            for row in conn.execute(query):
                found[row.task_id].append(
                    StepUsage(row.task_id, row.step_no, json.loads(row.usage), row.started_at)
                )
        return found


def _task(row: Any) -> TaskRecord:
    return TaskRecord(
        task_id=row["task_id"],
        spec=json.loads(row["spec"]),
        status=TaskStatus(row["status"]),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        owner=row["owner"],
        lease_epoch=row["lease_epoch"],
        lease_expires_at=row["lease_expires_at"],
        cancel_requested=bool(row["cancel_requested"]),
        result=row["result"],
        error=row["error"],
    )


def _step(row: Any) -> StepRecord:
    return StepRecord(
        task_id=row["task_id"],
        step_no=row["step_no"],
        epoch=row["epoch"],
        role=row["role"],
        message=json.loads(row["message"]),
        usage=json.loads(row["usage"]),
        messages_in=row["messages_in"],
        messages_in_digest=row["messages_in_digest"],
        started_at=row["started_at"],
        model_done_at=row["model_done_at"],
        status=StepStatus.COMMITTED if row["committed_at"] is not None else StepStatus.PLANNED,
        committed_at=row["committed_at"],
        snapshot_key=row["snapshot_key"],
    )


def _tool_call(row: Any) -> ToolCallRecord:
    observation = row["observation"]
    return ToolCallRecord(
        idempotency_key=row["idempotency_key"],
        task_id=row["task_id"],
        step_no=row["step_no"],
        call_index=row["call_index"],
        tool=row["tool"],
        arguments=json.loads(row["arguments"]),
        intent_at=row["intent_at"],
        observation=json.loads(observation) if observation is not None else None,
        observed_at=row["observed_at"],
        executions=row["executions"],
    )
