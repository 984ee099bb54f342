"""`Tool`: a function a model may call (its `ToolSpec`), its implementation, and the replay policy that says
how a crash around it is resolved. Environments and hosted agents register the same `Tool` objects.

A durable agent step (`tether.agents.runner`) goes: (1) the model's reply and each call's intent, keyed
`task:step:index`, are journaled in one transaction; (2) before a call runs, its `executions` counter is
incremented and committed; (3) the call runs; (4) the step commits: the observations not yet recorded,
the key of the workdir checkpoint (a content-addressed tar written before this transaction) and the
commit time, in one transaction fenced by the task's lease epoch. A worker may die anywhere between
these points.

Guarantee, per policy (`tether.agents.replay.resolve_call` applies it when a step is resumed):
- WORKDIR (shell, python, write_file): the effect is confined to the sandbox workdir, which exists only
  inside the worker's sandbox session. A resumed task restores the newest committed checkpoint and
  re-applies the committed WORKDIR calls after it (checkpoints every k steps), then re-runs the calls of
  the uncommitted step. A call's effect is therefore present exactly once in every state that survives:
  the copy made by an attempt that died was discarded with its sandbox. `executions` > 1 records such
  physical re-runs; they are not double effects. Re-applying after a checkpoint assumes the calls are
  deterministic given the same workdir; with `snapshot_every=1` (the default) nothing is re-applied.
- READ_ONLY (read_file, submit, finish, handoff): no effects; simply run again.
- EXTERNAL_IDEMPOTENT: effects outside the sandbox; the tool receives the idempotency key and must
  deduplicate on it (as payment APIs do). Its observation is recorded as soon as it returns.
- EXTERNAL_AT_MOST_ONCE: never run twice. If (2) committed and no observation was recorded, the call
  gets an "outcome unknown" observation the model can act on, instead of a second execution.
Not covered: effects a WORKDIR tool has outside the workdir (the sandbox has no network, so none by
design), and a journal that loses committed transactions: SQLite runs in WAL with synchronous=NORMAL,
so a killed process loses nothing but a power cut can drop the newest commits. They are then redone,
never half-applied, except that a lost (2) could let an EXTERNAL_AT_MOST_ONCE call run again; such tools
want the PostgreSQL journal. An RL episode journals nothing: there a crash loses the episode.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from jsonschema import Draft202012Validator, SchemaError  # type: ignore[import-untyped,unused-ignore]

from tether.chat import ChatError, JsonDict, ToolCall, ToolResult, ToolSpec
from tether.errors import TetherError
from tether.tools.workspace import Workspace


class ReplayPolicy(StrEnum):
    """How a resumed agent step treats a call a crash interrupted (the guarantees above)."""

    READ_ONLY = "read_only"
    WORKDIR = "workdir"
    EXTERNAL_IDEMPOTENT = "external_idempotent"
    EXTERNAL_AT_MOST_ONCE = "external_at_most_once"


class ToolError(TetherError):
    """A call the tool refuses or cannot complete; its message is what the model reads (`error=True`)."""


# (workspace, validated arguments, idempotency key) -> the text the model reads. Raise ToolError to fail.
ToolFunction = Callable[[Workspace, JsonDict, str], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool's spec and implementation.

    `ends`: a successful call is the final action of the episode or task (`submit`, `finish`); its result
    text is the final answer. `needs_workspace`: the tool touches the sandbox session, so an environment
    using it opens one per episode.
    """

    spec: ToolSpec
    function: ToolFunction
    policy: ReplayPolicy = ReplayPolicy.READ_ONLY
    ends: bool = False
    needs_workspace: bool = False
    _validator: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            Draft202012Validator.check_schema(self.spec.parameters)
        except SchemaError as error:
            raise ValueError(
                f"tool {self.spec.name!r}: parameters are not a JSON schema: {error.message}"
            ) from None
        if self.spec.parameters.get("type") != "object":
            raise ValueError(
                f"tool {self.spec.name!r}: parameters must describe an object ('type': 'object')"
            )
        object.__setattr__(self, "_validator", Draft202012Validator(self.spec.parameters))

    @property
    def name(self) -> str:
        return self.spec.name

    def check_arguments(self, arguments: object) -> JsonDict:
        """The arguments, if they are an object valid for the tool's schema; else a ToolError saying what
        is wrong and what would be accepted."""
        if not isinstance(arguments, dict):
            raise ToolError(
                f"bad arguments for {self.name}: expected a JSON object, got {type(arguments).__name__}"
            )
        problems = sorted(
            (
                "/".join(str(part) for part in error.absolute_path) or "arguments",
                error.message,
            )
            for error in self._validator.iter_errors(arguments)
        )
        if problems:
            listed = "; ".join(f"{where}: {message}" for where, message in problems)
            raise ToolError(f"bad arguments for {self.name}: {listed}; accepted: {self.accepted()}")
        return arguments

    def parse_arguments(self, call: ToolCall) -> JsonDict:
        """A call's JSON arguments string, parsed and checked."""
        try:
            return self.check_arguments(call.parsed_arguments())
        except ChatError as error:
            raise ToolError(f"bad arguments for {self.name}: {error}") from None

    def accepted(self) -> str:
        properties: Mapping[str, Any] = self.spec.parameters.get("properties", {})
        required = set(self.spec.parameters.get("required", ()))
        if not properties:
            return "no arguments"
        return ", ".join(
            f"{name} ({schema.get('type', 'any')}{', required' if name in required else ''})"
            for name, schema in properties.items()
        )

    async def run(self, workspace: Workspace, call: ToolCall, arguments: JsonDict, key: str) -> ToolResult:
        """Run the tool on checked `arguments`; a ToolError becomes an error result the model reads."""
        try:
            text = await self.function(workspace, arguments, key)
        except ToolError as error:
            return ToolResult(call.id, call.name, str(error), error=True)
        return ToolResult(call.id, call.name, text)


def refusal(call: ToolCall, reason: str) -> ToolResult:
    """The error result of a call that never ran (unknown tool, bad arguments, malformed call)."""
    return ToolResult(call.id, call.name, reason, error=True)
