"""Pure replay rules: from the journal's steps, where a task stands and what a resuming worker must do.

No I/O here. `plan_resume` reads committed and uncommitted steps and answers: which checkpoint to restore,
which committed workdir calls to re-apply on top of it (checkpoints every k steps), which journaled but
uncommitted step to finish, and whether the task already ended. `resolve_call` applies each tool's
replay policy (see `tether.tools.tool`) to a call whose step was interrupted. A call's observation is
journaled as `{"content": text, "error": bool}`, the `ToolResult` the model read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum

from tether.agents.task import Limits
from tether.chat import ToolCall, ToolResult
from tether.store.records import JsonDict, StepRecord, StepStatus, ToolCallRecord
from tether.tools import HANDOFF, ReplayPolicy, Tool, Toolbox


class CallAction(StrEnum):
    REUSE = "reuse"  # the observation is in the journal: never run it again
    EXECUTE = "execute"  # safe to run (again) with the same idempotency key
    OUTCOME_UNKNOWN = "outcome_unknown"  # at-most-once tool started and never reported: do not re-run


class Outcome(StrEnum):
    CONTINUE = "continue"
    FINISHED = "finished"
    HANDOFF = "handoff"


@dataclass(frozen=True, slots=True)
class StepOutcome:
    outcome: Outcome
    next_role: str
    summary: str = ""


@dataclass(frozen=True, slots=True)
class ResumePlan:
    next_step_no: int
    snapshot_key: str | None  # restore this first; None means start from the task's initial files
    reapply: tuple[ToolCallRecord, ...]  # committed workdir calls made after that checkpoint
    pending: StepRecord | None  # journaled, not committed: finish it before calling the model again
    role: str  # the role that takes the next step
    ended: StepOutcome | None  # the last committed step already finished the task


def observation_of(result: ToolResult) -> JsonDict:
    """A tool result as the journal keeps it."""
    return {"content": result.content, "error": result.error}


OUTCOME_UNKNOWN: JsonDict = {
    "content": "outcome unknown: the worker stopped during this call and the tool may not be run twice; "
    "check its effect before retrying",
    "error": True,
}


def call_of(step: StepRecord, call: ToolCallRecord) -> ToolCall:
    """The journaled call as the model made it: its id and raw arguments from the step's message."""
    raws = step.message.get("tool_calls") or []
    raw = (
        raws[call.call_index]
        if call.call_index < len(raws) and isinstance(raws[call.call_index], dict)
        else {}
    )
    function = raw.get("function")
    arguments = function.get("arguments", "{}") if isinstance(function, dict) else json.dumps(call.arguments)
    if not isinstance(arguments, str):  # some servers send an object; the journal keeps what came
        arguments = json.dumps(arguments)
    return ToolCall(str(raw.get("id") or f"call_{step.step_no}_{call.call_index}"), call.tool, arguments)


def resolve_call(call: ToolCallRecord, tool: Tool | None) -> CallAction:
    if call.observation is not None:
        return CallAction.REUSE
    if tool is not None and tool.policy is ReplayPolicy.EXTERNAL_AT_MOST_ONCE and call.executions > 0:
        return CallAction.OUTCOME_UNKNOWN
    return CallAction.EXECUTE


def parse_arguments(raw: object) -> JsonDict | str:
    """A tool call's arguments as a dict, or an error message for the model when they are not one."""
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        return f"arguments must be a JSON object, got {type(raw).__name__}"
    try:
        parsed = json.loads(raw or "{}")
    except json.JSONDecodeError as error:
        return f"arguments are not valid JSON ({error.msg} at position {error.pos})"
    return (
        parsed
        if isinstance(parsed, dict)
        else f"arguments must be a JSON object, got {type(parsed).__name__}"
    )


def step_outcome(
    step: StepRecord, tools: Toolbox, hands_off_to: tuple[str, ...], require_finish: bool = False
) -> StepOutcome:
    """What a completed step means for the task: go on, stop, or pass to another role.

    A successful call of a tool that `ends` (`finish`) stops the task, its result text the summary. A reply
    without tool calls is the final answer, unless the task requires an explicit `finish` (useful with
    small models that chat instead of acting: they are told to act and go on)."""
    if not step.tool_calls:
        if require_finish:
            return StepOutcome(Outcome.CONTINUE, step.role)
        return StepOutcome(Outcome.FINISHED, step.role, str(step.message.get("content") or ""))
    for call in step.tool_calls:
        observation = call.observation
        if observation is None or observation.get("error", True):
            continue
        tool = tools.get(call.tool)
        if tool is not None and tool.ends:
            return StepOutcome(Outcome.FINISHED, step.role, str(observation.get("content", "")))
        if call.tool == HANDOFF.name and call.arguments.get("to") in hands_off_to:
            return StepOutcome(
                Outcome.HANDOFF, str(call.arguments["to"]), str(call.arguments.get("message", ""))
            )
    return StepOutcome(Outcome.CONTINUE, step.role)


def tokens_of(step: StepRecord) -> int:
    return int(step.usage.get("prompt_tokens", 0)) + int(step.usage.get("completion_tokens", 0))


def spent_budget(limits: Limits, steps: list[StepRecord], elapsed_s: float) -> str | None:
    """Which of the task's budgets its steps have used up (None: it may take another step)."""
    tokens_used = sum(tokens_of(step) for step in steps)
    if len(steps) >= limits.max_steps:
        return f"step budget exhausted: {len(steps)} of max_steps={limits.max_steps}"
    if tokens_used >= limits.max_tokens:
        return f"token budget exhausted: {tokens_used} of max_tokens={limits.max_tokens}"
    if elapsed_s >= limits.wall_clock_s:
        return f"wall-clock budget exhausted: wall_clock_s={limits.wall_clock_s}"
    return None


def plan_resume(
    steps: list[StepRecord],
    tools: Toolbox,
    first_role: str,
    hands_off: dict[str, tuple[str, ...]],
    require_finish: bool = False,
) -> ResumePlan:
    for expected, step in enumerate(steps):
        assert step.step_no == expected, f"journal of {step.task_id} has a gap before step {step.step_no}"
    committed = [step for step in steps if step.status is StepStatus.COMMITTED]
    pending = steps[-1] if steps and steps[-1].status is StepStatus.PLANNED else None
    assert len(committed) == len(steps) - (pending is not None), "only the newest step may be uncommitted"
    snapshot_at = max((s.step_no for s in committed if s.snapshot_key), default=-1)
    snapshot_key = committed[snapshot_at].snapshot_key if snapshot_at >= 0 else None
    reapply = tuple(
        call
        for step in committed[snapshot_at + 1 :]
        for call in step.tool_calls
        # Refused calls (bad arguments, a tool the role may not use) never ran: nothing to rebuild.
        if call.executions > 0
        and (tool := tools.get(call.tool)) is not None
        and tool.policy is ReplayPolicy.WORKDIR
    )
    role, ended = first_role, None
    for step in committed:
        outcome = step_outcome(step, tools, hands_off.get(step.role, ()), require_finish)
        role = outcome.next_role
        if outcome.outcome is Outcome.FINISHED:
            ended = outcome
    return ResumePlan(
        next_step_no=len(steps),
        snapshot_key=snapshot_key,
        reapply=reapply,
        pending=pending,
        role=pending.role if pending else role,
        ended=ended,
    )
