"""What the model sees at each step: a stable header, a digest of older steps, recent steps verbatim.

The system prompt and the task header never change during a task, and the digest of older steps changes
only when whole blocks of `recent_steps` steps are folded into it, so consecutive calls share a long
identical prefix and the server's prefix cache pays. A `ContextPlan` says where the verbatim steps begin
and which oldest steps the digest leaves out (`context_budget.py` chooses it to fit a token budget; by
default blocks fold by count alone). Pure functions over journal records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tether.agents.loops import LoopMark, loop_marks
from tether.agents.replay import call_of
from tether.agents.task import RoleSpec, TaskSpec
from tether.chat import ToolResult
from tether.store.records import JsonDict, StepRecord


def task_header(spec: TaskSpec, role: RoleSpec) -> str:
    roles = ", ".join(r.name for r in spec.roles)
    handoff = f" You may hand off to: {', '.join(role.hands_off_to)}." if role.hands_off_to else ""
    return f"Goal: {spec.goal}\nYou act as the {role.name} (team: {roles}).{handoff}"


def render_observation(observation: JsonDict | None, limit_chars: int) -> str:
    """A journaled tool result as the model reads it, its middle cut when it is long."""
    if observation is None:
        return "(no output)"
    text = str(observation.get("content", ""))
    if len(text) <= limit_chars:
        return text
    half = limit_chars // 2
    return f"{text[:half]} ...[{len(text) - limit_chars} characters cut]... {text[-half:]}"


NO_ACTION_NUDGE = (
    "Your last reply called no tool. Act by calling one of your tools, or end the task by calling `finish`."
)


def step_messages(
    step: StepRecord, limit_chars: int, nudge: bool = False, loop: LoopMark | None = None
) -> list[JsonDict]:
    """The step as the model sees it again: its reply, its tools' results, then any nudge after it."""
    messages: list[JsonDict] = [step.message]
    if nudge and not step.tool_calls:
        messages.append({"role": "user", "content": NO_ACTION_NUDGE})
    for call in step.tool_calls:
        result = ToolResult(
            call_of(step, call).id, call.tool, render_observation(call.observation, limit_chars)
        )
        messages.append(result.message())
    if loop is not None and not loop.stop:
        messages.append({"role": "user", "content": loop.nudge_message()})
    return messages


@dataclass(frozen=True, slots=True)
class ContextPlan:
    """Steps before `folded` are shown only in the digest, steps before `elided` not even there (their
    observations come back only when recalled)."""

    folded: int
    elided: int = 0

    def __post_init__(self) -> None:
        assert 0 <= self.elided <= self.folded


def digest_line(step: StepRecord, chars_per_step: int) -> str:
    """One older step in a line: what it said, what it called and what came back, each cut short."""
    actions = "; ".join(f"{call.tool}({json.dumps(call.arguments)[:80]})" for call in step.tool_calls)
    said = str(step.message.get("content") or "").strip().replace("\n", " ")
    results = " | ".join(render_observation(call.observation, chars_per_step) for call in step.tool_calls)
    line = f"[{step.step_no} {step.role}] {said[:chars_per_step]} -> {actions or 'no tools'}: {results}"
    return line[: 3 * chars_per_step]


DIGEST_TITLE = "Earlier steps, summarised (oldest first):"


def elided_note(first_kept: int, recall: bool) -> str:
    where = "; what bears on the current step is recalled at the end" if recall else ""
    return f"Steps before step {first_kept} are left out of this summary{where}."


def digest(steps: list[StepRecord], chars_per_step: int, elided: int = 0, recall: bool = False) -> str:
    """The digest of `steps` (the folded ones), its first `elided` left out but for a note saying so."""
    lines = [elided_note(steps[elided - 1].step_no + 1, recall)] if elided else []
    lines.append(DIGEST_TITLE)
    lines += [digest_line(step, chars_per_step) for step in steps[elided:]]
    return "\n".join(lines)


def folded_count(total_steps: int, recent_steps: int) -> int:
    """How many of the oldest steps go into the digest: whole blocks, so it changes every block only."""
    if total_steps <= recent_steps:
        return 0
    return ((total_steps - recent_steps) // recent_steps) * recent_steps


def recall_query(steps: list[StepRecord], limit_chars: int) -> str:
    """What the agent is dealing with now: the newest step's words and results."""
    if not steps:
        return ""
    return "\n".join(str(m.get("content") or "") for m in step_messages(steps[-1], limit_chars))


def recall_items(steps: list[StepRecord], limit_chars: int) -> list[tuple[str, str]]:
    """(idempotency key, text) for every tool call of these steps, as the memory indexes them."""
    return [
        (
            call.idempotency_key,
            f"step {step.step_no} {call.tool} {json.dumps(call.arguments)[:200]}: "
            f"{render_observation(call.observation, limit_chars)}",
        )
        for step in steps
        for call in step.tool_calls
    ]


def verbatim_steps(spec: TaskSpec, steps: list[StepRecord], start: int = 0) -> list[list[JsonDict]]:
    """The messages of each step from `start` on, as shown verbatim (nudges and loop marks included)."""
    marks = loop_marks(steps, spec.loop)
    return [
        step_messages(step, spec.context.observation_chars, nudge=spec.require_finish, loop=mark)
        for step, mark in zip(steps[start:], marks[start:], strict=True)
    ]


def build_messages(
    spec: TaskSpec,
    role: RoleSpec,
    steps: list[StepRecord],
    recalled: list[str] | None = None,
    plan: ContextPlan | None = None,
) -> list[JsonDict]:
    """The step's messages; without a `plan`, whole blocks fold by count (`folded_count`), none elided."""
    messages: list[JsonDict] = [
        {"role": "system", "content": role.system_prompt},
        {"role": "user", "content": task_header(spec, role)},
    ]
    plan = plan or ContextPlan(folded_count(len(steps), spec.context.recent_steps))
    assert plan.folded <= len(steps)
    if plan.folded:
        context = spec.context
        text = digest(steps[: plan.folded], context.summary_chars, plan.elided, context.recall_k > 0)
        messages.append({"role": "user", "content": text})
    for shown in verbatim_steps(spec, steps, plan.folded):
        messages.extend(shown)
    if recalled:
        # Last, after the stable part: it changes every step and would otherwise break the cached prefix.
        lines = "\n".join(f"- {text}" for text in recalled)
        messages.append({"role": "user", "content": f"Possibly relevant earlier observations:\n{lines}"})
    return messages
