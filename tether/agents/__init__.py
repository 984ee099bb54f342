"""Durable long-horizon agents: tasks driven step by step through a model and sandbox tools, every step
journaled before it is acted on, resumable by any worker after any crash."""

from tether.agents.model import (
    ChatModel,
    ModelReply,
    ModelRequest,
    OpenAIChatModel,
    ScriptedModel,
    open_model,
)
from tether.agents.roles import PRESET_ROLES, select_roles
from tether.agents.runner import RunnerConfig, TaskRunner
from tether.agents.service import AgentsConfig, AgentStack
from tether.agents.task import ContextSpec, Limits, RoleSpec, TaskSpec
from tether.agents.telemetry import Telemetry
from tether.agents.tools import BUILTIN_TOOLS, ReplayPolicy, Tool
from tether.agents.worker import AgentWorker, WorkerConfig

__all__ = [
    "BUILTIN_TOOLS",
    "PRESET_ROLES",
    "AgentStack",
    "AgentWorker",
    "AgentsConfig",
    "ChatModel",
    "ContextSpec",
    "Limits",
    "ModelReply",
    "ModelRequest",
    "OpenAIChatModel",
    "ReplayPolicy",
    "RoleSpec",
    "RunnerConfig",
    "ScriptedModel",
    "TaskRunner",
    "TaskSpec",
    "Telemetry",
    "Tool",
    "WorkerConfig",
    "open_model",
    "select_roles",
]
