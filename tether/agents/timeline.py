"""A task's journal as readable lines (`tether agent logs`): one line per step, one per tool call."""

from __future__ import annotations

import json
import time

from tether.agents.check import CheckOutcome, without_outcome
from tether.agents.loops import LoopMark, loop_marks
from tether.agents.task import LoopSpec
from tether.store.records import JsonDict, StepRecord, StepStatus, TaskRecord


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"


def _short(text: str, limit: int) -> str:
    text = text.strip().replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def step_lines(step: StepRecord, width: int = 100, loop: LoopMark | None = None) -> list[str]:
    """The step's line, one per tool call, and one for the loop nudge or stop that followed it."""
    tokens = int(step.usage.get("prompt_tokens", 0)) + int(step.usage.get("completion_tokens", 0))
    state = "" if step.status is StepStatus.COMMITTED else " (in progress)"
    said = _short(str(step.message.get("content") or ""), width)
    lines = [f"{_clock(step.started_at)} step {step.step_no:>3} [{step.role}] {tokens} tok{state}: {said}"]
    for call in step.tool_calls:
        arguments = _short(json.dumps(call.arguments, ensure_ascii=False), width // 2)
        if call.observation is None:
            result = "pending"
        else:
            marker = "error: " if call.observation.get("error") else ""
            result = marker + _short(str(call.observation.get("content", "")), width // 2)
        lines.append(f"    -> {call.tool} {arguments} => {result}")
    if loop is not None and step.status is StepStatus.COMMITTED:
        lines.append(f"    !! {loop.describe()}")
    return lines


def timeline_lines(steps: list[StepRecord], spec: JsonDict, width: int = 100) -> list[list[str]]:
    """`step_lines` of every step, with the loop marks that the task's spec gives them."""
    marks = loop_marks(steps, LoopSpec.model_validate(spec.get("loop", {})))
    return [step_lines(step, width, mark) for step, mark in zip(steps, marks, strict=True)]


def task_line(task: TaskRecord) -> str:
    text = task.error or task.result
    outcome = without_outcome(text)
    check = CheckOutcome.find(text)
    line = f"task {task.task_id} {task.status.value}" + (f": {_short(outcome, 200)}" if outcome else "")
    return line + (f"; success check {check.describe()}" if check else "")
