"""Loop detection: a pure policy over a task's steps that nudges a model repeating itself and stops it.

A step repeats the one before when it asks for the same tool calls (names and arguments) or, calling no
tool, says the same words. Once `repeats_before_nudge` identical steps stand in a row, the model is told
so (a nudge: a user message after that step, which the timeline shows); each further repeat is nudged
again, and a repeat after `nudges_before_stop` nudges ends the task as failed. Marks are derived from
the journaled steps and the journaled spec only, so a resumed task sees the same nudges and stops at the
same step on any worker. Longer cycles (A, B, A, B) are not detected; the step budget bounds those.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tether.agents.task import LoopSpec
from tether.store.records import StepRecord


@dataclass(frozen=True, slots=True)
class LoopMark:
    """The verdict after a step that ends a run of `repeats` identical steps."""

    repeats: int
    nudge: int  # this nudge's number, from 1; 0 when the task stops instead
    nudges_allowed: int

    @property
    def stop(self) -> bool:
        return self.nudge == 0

    def nudge_message(self) -> str:
        """What the model reads after the step (a user message)."""
        return (
            f"You have sent the same reply {self.repeats} times in a row; repeating it will not get you "
            "further. Do something different: read the last output, fix what failed, try another "
            f"approach, or call `finish` if the goal is met. (Warning {self.nudge} of "
            f"{self.nudges_allowed}: the task stops if you repeat it again after the last warning.)"
        )

    def describe(self) -> str:
        """One line for the timeline and the task's error."""
        if self.stop:
            return (
                f"stopped: the model sent the same reply {self.repeats} times in a row and ignored "
                f"{self.nudges_allowed} nudge(s) (loop.nudges_before_stop={self.nudges_allowed})"
            )
        return f"nudged ({self.nudge} of {self.nudges_allowed}): the same reply {self.repeats} times in a row"


def action_of(step: StepRecord) -> str:
    """What a step asked for, as a comparable string: its tool calls, or its words if it called none."""
    if step.tool_calls:
        return json.dumps([[call.tool, call.arguments] for call in step.tool_calls], sort_keys=True)
    return " ".join(str(step.message.get("content") or "").split())


def _mark(repeats: int, policy: LoopSpec) -> LoopMark | None:
    if repeats < policy.repeats_before_nudge:
        return None
    nudge = repeats - policy.repeats_before_nudge + 1
    return LoopMark(repeats, nudge if nudge <= policy.nudges_before_stop else 0, policy.nudges_before_stop)


def loop_marks(steps: list[StepRecord], policy: LoopSpec) -> list[LoopMark | None]:
    """For each step, the nudge or stop that follows it (None: it does not end a long enough run)."""
    marks: list[LoopMark | None] = []
    repeats, previous = 0, None
    for step in steps:
        action = action_of(step)
        repeats = repeats + 1 if action == previous else 1
        previous = action
        marks.append(_mark(repeats, policy))
    return marks


def last_mark(steps: list[StepRecord], policy: LoopSpec) -> LoopMark | None:
    """`loop_marks(steps, policy)[-1]`, reading back only as far as the newest run of repeats."""
    if not steps:
        return None
    newest = action_of(steps[-1])
    repeats = 1
    while repeats < len(steps) and action_of(steps[-1 - repeats]) == newest:
        repeats += 1
    return _mark(repeats, policy)
