"""What the journal holds: tasks, steps and tool calls as plain frozen records, free of any I/O.

A step is the unit of durability: one model call (its output and usage) and the tool calls it asked
for, each carrying an idempotency key derived from `(task_id, step_no, call_index)`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

JsonDict = dict[str, Any]


class TaskStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED)


class StepStatus(StrEnum):
    PLANNED = "planned"  # model output journaled; its tool calls may or may not have run
    COMMITTED = "committed"  # every observation recorded and the workdir checkpoint (if any) written


@dataclass(frozen=True, slots=True)
class TaskRecord:
    task_id: str
    spec: JsonDict
    status: TaskStatus
    created_at: float
    updated_at: float
    owner: str | None = None
    lease_epoch: int = 0
    lease_expires_at: float = 0.0
    cancel_requested: bool = False
    result: str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCallRecord:
    idempotency_key: str
    task_id: str
    step_no: int
    call_index: int
    tool: str
    arguments: JsonDict
    intent_at: float
    observation: JsonDict | None = None
    observed_at: float | None = None
    executions: int = 0  # physical attempts, including ones whose effects died with a worker


@dataclass(frozen=True, slots=True)
class StepRecord:
    task_id: str
    step_no: int
    epoch: int
    role: str
    message: JsonDict  # the assistant message the model returned (OpenAI chat format)
    usage: JsonDict
    messages_in: int  # how many messages the model saw; the messages themselves are derivable
    messages_in_digest: str
    started_at: float
    model_done_at: float
    status: StepStatus = StepStatus.PLANNED
    committed_at: float | None = None
    snapshot_key: str | None = None
    tool_calls: tuple[ToolCallRecord, ...] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class StepUsage:
    """A step's tokens and start alone: what lists of tasks total, without reading replies or tool calls."""

    task_id: str
    step_no: int
    usage: JsonDict
    started_at: float


def idempotency_key(task_id: str, step_no: int, call_index: int) -> str:
    """Stable across replays: the same step of the same task always names its calls the same way."""
    return f"{task_id}:{step_no}:{call_index}"


def messages_digest(messages: list[JsonDict]) -> str:
    encoded = json.dumps(messages, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(encoded).hexdigest()[:32]
