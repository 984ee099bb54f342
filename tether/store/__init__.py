"""Durable state of agent tasks: the step journal (SQLite or PostgreSQL) and the artifact store.

The public names are loaded on first use, so that importing the records does not import SQLAlchemy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tether.store.artifacts import ArtifactMissing, ArtifactStore
    from tether.store.database import make_engine
    from tether.store.journal import Journal, LeaseLost, UnknownTask
    from tether.store.records import (
        StepRecord,
        StepStatus,
        TaskRecord,
        TaskStatus,
        ToolCallRecord,
        idempotency_key,
        messages_digest,
    )

_EXPORTS = {
    "ArtifactMissing": "tether.store.artifacts",
    "ArtifactStore": "tether.store.artifacts",
    "Journal": "tether.store.journal",
    "LeaseLost": "tether.store.journal",
    "StepRecord": "tether.store.records",
    "StepStatus": "tether.store.records",
    "TaskRecord": "tether.store.records",
    "TaskStatus": "tether.store.records",
    "ToolCallRecord": "tether.store.records",
    "UnknownTask": "tether.store.journal",
    "idempotency_key": "tether.store.records",
    "make_engine": "tether.store.database",
    "messages_digest": "tether.store.records",
}

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


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tether.store' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
