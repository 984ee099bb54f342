"""The built-in tools, defined once for environments and hosted agents: `shell`, `python`, `write_file`,
`read_file`, `submit`, `finish` and `handoff`.

They act only through the `Workspace` (a sandbox session), so files persist between calls and nothing
runs in this process. Results are plain text a model reads; a run that does not end with status ok
(non-zero exit, timeout, memory limit) is an error result carrying the same text. `submit` and `finish`
end the episode or task; their result text is the final answer (the answer, the summary). `handoff`
only names the next role: the agent runner checks it against the role's `hands_off_to`.
"""

from __future__ import annotations

from tether.chat import JsonDict, ToolSpec
from tether.sandbox.result import RunResult, RunStatus
from tether.tools.tool import ReplayPolicy, Tool, ToolError
from tether.tools.toolbox import Toolbox
from tether.tools.workspace import Workspace, WorkspaceError


def describe_run(result: RunResult) -> str:
    """A sandbox run as the text a model sees: status, exit code, stdout and stderr."""
    parts = [f"status: {result.status.value}"]
    if result.exit_code is not None:
        parts.append(f"exit code: {result.exit_code}")
    if result.stdout:
        parts.append("stdout:\n" + result.stdout)
    if result.stderr:
        parts.append("stderr:\n" + result.stderr)
    return "\n".join(parts)


def read_run(text: str) -> tuple[str | None, int | None]:
    """The status and exit code at the head of a `describe_run` text (None for what it does not start
    with): only its first two lines count, so a program that prints `exit code: 5` cannot pose as one."""
    lines = text.split("\n", 2)
    status = lines[0].removeprefix("status: ") if lines[0].startswith("status: ") else None
    second = lines[1] if status is not None and len(lines) > 1 else ""
    code = second.removeprefix("exit code: ")
    exit_code = int(code) if second.startswith("exit code: ") and code.lstrip("-").isdigit() else None
    return status, exit_code


async def _run(workspace: Workspace, code: str, language: str) -> str:
    try:
        result = await workspace.run(code, language)
    except WorkspaceError as error:
        raise ToolError(str(error)) from None
    text = describe_run(result)
    if result.status is not RunStatus.OK:
        raise ToolError(text)
    return text


async def _shell(workspace: Workspace, arguments: JsonDict, _key: str) -> str:
    return await _run(workspace, arguments["command"], "bash")


async def _python(workspace: Workspace, arguments: JsonDict, _key: str) -> str:
    return await _run(workspace, arguments["code"], "python")


async def _write_file(workspace: Workspace, arguments: JsonDict, _key: str) -> str:
    path, content = arguments["path"], arguments["content"]
    try:
        await workspace.write_file(path, content)
    except (WorkspaceError, ValueError) as error:  # the sandbox refuses paths outside the workdir
        raise ToolError(f"cannot write {path!r}: {error}") from None
    return f"wrote {len(content.encode())} bytes to {path}"


async def _read_file(workspace: Workspace, arguments: JsonDict, _key: str) -> str:
    path = arguments["path"]
    try:
        data = await workspace.read_file(path)
    except FileNotFoundError:
        raise ToolError(f"no such file: {path}") from None
    except (WorkspaceError, ValueError) as error:
        raise ToolError(f"cannot read {path!r}: {error}") from None
    return data.decode(errors="replace")


async def _submit(_workspace: Workspace, arguments: JsonDict, _key: str) -> str:
    return str(arguments["answer"]).strip()


async def _finish(_workspace: Workspace, arguments: JsonDict, _key: str) -> str:
    return str(arguments.get("summary", ""))


async def _handoff(_workspace: Workspace, arguments: JsonDict, _key: str) -> str:
    return f"handed off to {arguments['to']}"


def _object(required: dict[str, str], optional: dict[str, str] | None = None) -> JsonDict:
    """A flat object of string arguments, each described."""
    properties = {name: {"type": "string", "description": text} for name, text in required.items()}
    properties |= {name: {"type": "string", "description": text} for name, text in (optional or {}).items()}
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


SHELL = Tool(
    ToolSpec(
        "shell",
        "Run a bash command in the sandbox's working directory (no network); files persist between calls.",
        _object({"command": "The bash command line."}),
    ),
    _shell,
    ReplayPolicy.WORKDIR,
    needs_workspace=True,
)
PYTHON = Tool(
    ToolSpec(
        "python",
        "Run a Python 3 program in the sandbox's working directory; files persist between calls.",
        _object({"code": "The program's source."}),
    ),
    _python,
    ReplayPolicy.WORKDIR,
    needs_workspace=True,
)
WRITE_FILE = Tool(
    ToolSpec(
        "write_file",
        "Create or overwrite a file in the working directory.",
        _object({"path": "Path relative to the working directory.", "content": "The full new content."}),
    ),
    _write_file,
    ReplayPolicy.WORKDIR,
    needs_workspace=True,
)
READ_FILE = Tool(
    ToolSpec(
        "read_file",
        "Read a file from the working directory.",
        _object({"path": "Path relative to the working directory."}),
    ),
    _read_file,
    ReplayPolicy.READ_ONLY,
    needs_workspace=True,
)
SUBMIT = Tool(
    ToolSpec(
        "submit", "Submit your final answer; this ends the episode.", _object({"answer": "The final answer."})
    ),
    _submit,
    ReplayPolicy.READ_ONLY,
    ends=True,
)
FINISH = Tool(
    ToolSpec("finish", "Declare the goal met and end the task.", _object({}, {"summary": "What was done."})),
    _finish,
    ReplayPolicy.READ_ONLY,
    ends=True,
)
HANDOFF = Tool(
    ToolSpec(
        "handoff",
        "Pass the task to another role.",
        _object({"to": "The role to hand off to."}, {"message": "What they should do."}),
    ),
    _handoff,
    ReplayPolicy.READ_ONLY,
)
BUILTIN_TOOLS = Toolbox((SHELL, PYTHON, WRITE_FILE, READ_FILE, SUBMIT, FINISH, HANDOFF))
