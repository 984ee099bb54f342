"""Durable state of agent tasks: the step journal (SQLite or PostgreSQL) and the artifact store."""

from tether.store.artifacts import ArtifactMissing, ArtifactStore
from tether.store.journal import Journal, LeaseLost, UnknownTask, make_engine
from tether.store.records import (
    StepRecord,
    StepStatus,
    TaskRecord,
    TaskStatus,
    ToolCallRecord,
    idempotency_key,
    messages_digest,
)

__all__ = [
    "ArtifactMissing",
    "ArtifactStore",
    "Journal",
    "LeaseLost",
    "StepRecord",
    "StepStatus",
    "TaskRecord",
    "TaskStatus",
    "ToolCallRecord",
    "UnknownTask",
    "idempotency_key",
    "make_engine",
    "messages_digest",
]
