"""The tools an agent may call, each with a replay policy that says how a crash around it is resolved.

The sequence for every step: (1) the model's reply and each call's intent, keyed `task:step:index`, are
journaled in one transaction; (2) before a call runs, its `executions` counter is incremented and
committed; (3) the call runs; (4) the step commits: the observations not yet recorded, the key of the
workdir checkpoint (a content-addressed tar written before this transaction) and the commit time, in one
transaction fenced by the task's lease epoch. A worker may die anywhere between these points.

Guarantee, per policy (`replay.resolve_call` applies it when a step is resumed):
- WORKDIR (bash, python, write_file): the effect is confined to the sandbox workdir, which exists only
  inside the worker's sandbox session. A resumed task restores the newest committed checkpoint and
  re-applies the committed WORKDIR calls after it (checkpoints every k steps), then re-runs the calls of
  the uncommitted step. A call's effect is therefore present exactly once in every state that survives:
  the copy made by an attempt that died was discarded with its sandbox. `executions` > 1 records such
  physical re-runs; they are not double effects. Re-applying after a checkpoint assumes the calls are
  deterministic given the same workdir; with `snapshot_every=1` (the default) nothing is re-applied.
- READ_ONLY (read_file, finish, handoff): no effects; simply run again.
- EXTERNAL_IDEMPOTENT: effects outside the sandbox; the tool receives the idempotency key and must
  deduplicate on it (as payment APIs do). Its observation is recorded as soon as it returns.
- EXTERNAL_AT_MOST_ONCE: never run twice. If (2) committed and no observation was recorded, the call
  gets an "outcome unknown" observation the model can act on, instead of a second execution.
Not covered: effects a WORKDIR tool has outside the workdir (the sandbox has no network, so none by
design), and a journal that loses committed transactions: SQLite runs in WAL with synchronous=NORMAL,
so a killed process loses nothing but a power cut can drop the newest commits. They are then redone,
never half-applied, except that a lost (2) could let an EXTERNAL_AT_MOST_ONCE call run again; such tools
want the PostgreSQL journal.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from tether.sandbox.result import RunResult

JsonDict = dict[str, Any]


class ReplayPolicy(StrEnum):
    READ_ONLY = "read_only"
    WORKDIR = "workdir"
    EXTERNAL_IDEMPOTENT = "external_idempotent"
    EXTERNAL_AT_MOST_ONCE = "external_at_most_once"


class Workspace(Protocol):
    async def run(self, code: str, language: str) -> RunResult: ...

    async def write_file(self, path: str, content: str) -> None: ...

    async def read_file(self, path: str) -> bytes: ...


ToolFunction = Callable[[Workspace, JsonDict, str], Awaitable[JsonDict]]


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: JsonDict  # JSON Schema of the arguments
    policy: ReplayPolicy
    function: ToolFunction

    def schema(self) -> JsonDict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def argument_error(self, arguments: JsonDict) -> str | None:
        """Built-in tools take flat objects of strings; say exactly what is wrong with anything else."""
        properties: JsonDict = self.parameters["properties"]
        missing = [name for name in self.parameters["required"] if name not in arguments]
        unknown = sorted(set(arguments) - set(properties))
        wrong = sorted(
            name for name, value in arguments.items() if name in properties and not isinstance(value, str)
        )
        if missing or unknown or wrong:
            problems = [f"missing {missing}" if missing else "", f"unknown {unknown}" if unknown else ""]
            problems.append(f"not strings {wrong}" if wrong else "")
            accepted = ", ".join(properties) or "no arguments"
            return (
                f"bad arguments for {self.name}: {'; '.join(p for p in problems if p)}; accepted: {accepted}"
            )
        return None


def _run_observation(result: RunResult) -> JsonDict:
    return {
        "status": result.status.value,
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
    }


async def _bash(workspace: Workspace, arguments: JsonDict, _key: str) -> JsonDict:
    return _run_observation(await workspace.run(arguments["command"], "bash"))


async def _python(workspace: Workspace, arguments: JsonDict, _key: str) -> JsonDict:
    return _run_observation(await workspace.run(arguments["code"], "python"))


async def _write_file(workspace: Workspace, arguments: JsonDict, _key: str) -> JsonDict:
    await workspace.write_file(arguments["path"], arguments["content"])
    return {"written": arguments["path"], "bytes": len(arguments["content"].encode())}


async def _read_file(workspace: Workspace, arguments: JsonDict, _key: str) -> JsonDict:
    try:
        data = await workspace.read_file(arguments["path"])
    except FileNotFoundError:
        return {"error": f"no such file: {arguments['path']}"}
    return {"content": data.decode(errors="replace")}


async def _finish(_workspace: Workspace, arguments: JsonDict, _key: str) -> JsonDict:
    return {"finished": True, "summary": arguments.get("summary", "")}


async def _handoff(_workspace: Workspace, arguments: JsonDict, _key: str) -> JsonDict:
    return {"handoff": arguments["to"], "message": arguments.get("message", "")}


def _object(required: dict[str, str], optional: dict[str, str] | None = None) -> JsonDict:
    properties = {name: {"type": "string", "description": text} for name, text in required.items()}
    properties |= {name: {"type": "string", "description": text} for name, text in (optional or {}).items()}
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


BUILTIN_TOOLS: dict[str, Tool] = {
    tool.name: tool
    for tool in (
        Tool(
            "bash",
            "Run a bash command in the working directory.",
            _object({"command": "The command."}),
            ReplayPolicy.WORKDIR,
            _bash,
        ),
        Tool(
            "python",
            "Run a Python program in the working directory.",
            _object({"code": "The program."}),
            ReplayPolicy.WORKDIR,
            _python,
        ),
        Tool(
            "write_file",
            "Create or overwrite a file in the working directory.",
            _object({"path": "Relative path.", "content": "Full new content."}),
            ReplayPolicy.WORKDIR,
            _write_file,
        ),
        Tool(
            "read_file",
            "Read a file from the working directory.",
            _object({"path": "Relative path."}),
            ReplayPolicy.READ_ONLY,
            _read_file,
        ),
        Tool(
            "finish",
            "Declare the goal met and end the task.",
            _object({}, {"summary": "What was done."}),
            ReplayPolicy.READ_ONLY,
            _finish,
        ),
        Tool(
            "handoff",
            "Pass the task to another role.",
            _object({"to": "The role to hand off to."}, {"message": "What they should do."}),
            ReplayPolicy.READ_ONLY,
            _handoff,
        ),
    )
}
