"""The tools models call, defined once for environments and hosted agents, run in a sandbox session."""

from tether.tools.builtin import (
    BUILTIN_TOOLS,
    FINISH,
    HANDOFF,
    PYTHON,
    READ_FILE,
    SHELL,
    SUBMIT,
    WRITE_FILE,
    describe_run,
)
from tether.tools.tool import ReplayPolicy, Tool, ToolError, ToolFunction, refusal
from tether.tools.toolbox import Toolbox
from tether.tools.workspace import NoWorkspace, SandboxWorkspace, Workspace, WorkspaceError

__all__ = [
    "BUILTIN_TOOLS",
    "FINISH",
    "HANDOFF",
    "PYTHON",
    "READ_FILE",
    "SHELL",
    "SUBMIT",
    "WRITE_FILE",
    "NoWorkspace",
    "ReplayPolicy",
    "SandboxWorkspace",
    "Tool",
    "ToolError",
    "ToolFunction",
    "Toolbox",
    "Workspace",
    "WorkspaceError",
    "describe_run",
    "refusal",
]
