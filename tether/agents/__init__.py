"""Durable long-horizon agents: tasks driven step by step through a model (any `tether.chat.ChatClient`,
tools sent as OpenAI `tools` and called natively) and the sandbox tools of `tether.tools`, every step
journaled before it is acted on, resumable by any worker after any crash. A task may carry a success
check (`check.py`) and come from a seeded family (`families.py`), which `tether train` also trains on.

The public names are loaded on first use, so that a command needing one light module (the task
spec, the timeline) does not import the journal's SQL, the bus clients and telemetry.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tether.agents.check import CheckOutcome
    from tether.agents.families import FAMILIES, AgentFamily, family
    from tether.agents.roles import PRESET_ROLES, select_roles
    from tether.agents.runner import RunnerConfig, TaskRunner
    from tether.agents.service import AgentsConfig, AgentStack
    from tether.agents.task import CheckSpec, ContextSpec, Limits, RoleSpec, TaskSpec
    from tether.agents.telemetry import Telemetry
    from tether.agents.worker import AgentWorker, WorkerConfig

_EXPORTS = {
    "FAMILIES": "tether.agents.families",
    "AgentFamily": "tether.agents.families",
    "AgentStack": "tether.agents.service",
    "AgentWorker": "tether.agents.worker",
    "AgentsConfig": "tether.agents.service",
    "CheckOutcome": "tether.agents.check",
    "CheckSpec": "tether.agents.task",
    "ContextSpec": "tether.agents.task",
    "Limits": "tether.agents.task",
    "PRESET_ROLES": "tether.agents.roles",
    "RoleSpec": "tether.agents.task",
    "RunnerConfig": "tether.agents.runner",
    "TaskRunner": "tether.agents.runner",
    "TaskSpec": "tether.agents.task",
    "Telemetry": "tether.agents.telemetry",
    "WorkerConfig": "tether.agents.worker",
    "family": "tether.agents.families",
    "select_roles": "tether.agents.roles",
}

__all__ = [
    "FAMILIES",
    "PRESET_ROLES",
    "AgentFamily",
    "AgentStack",
    "AgentWorker",
    "AgentsConfig",
    "CheckOutcome",
    "CheckSpec",
    "ContextSpec",
    "Limits",
    "RoleSpec",
    "RunnerConfig",
    "TaskRunner",
    "TaskSpec",
    "Telemetry",
    "WorkerConfig",
    "family",
    "select_roles",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tether.agents' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
