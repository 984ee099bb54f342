"""What the agents pages show, read from the agent journal: tasks with their budget use and cost, and a
task's step timeline (model reply, tool calls with their sandbox output and exit status, timings, tokens,
the role that acted, resumptions after a crash). The views are pure functions of the journal's records;
`read_*` fetch what a page needs in a few queries (a page of steps, not the whole task); no HTML here.

The journal keeps a step's lease epoch, not the worker's name, so a step says under which lease it ran and
where the epoch changed without a hand-off (another worker, or the same one restarted, resumed the task);
the worker holding the task now is the task's owner.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tether.agents.check import CheckOutcome, without_outcome
from tether.agents.loops import loop_marks
from tether.agents.task import Limits, LoopSpec
from tether.chat.completion import Usage
from tether.chat.pricing import DEFAULT_PRICES, Tier, cost_usd
from tether.store.journal import Journal
from tether.store.records import (
    JsonDict,
    StepRecord,
    StepStatus,
    StepUsage,
    TaskRecord,
    TaskStatus,
    ToolCallRecord,
)
from tether.tools.builtin import read_run

# Agent tasks are priced as gateway traffic of the standard tier would be: what the same tokens cost there.
PRICE = DEFAULT_PRICES[Tier.STANDARD]
# How many of the newest steps a task page shows before "load earlier".
PAGE_STEPS = 50


@dataclass(frozen=True, slots=True)
class BudgetUse:
    steps: int
    max_steps: int
    tokens: int
    max_tokens: int
    elapsed_s: float
    wall_clock_s: float

    @property
    def step_share(self) -> float:
        return min(1.0, self.steps / self.max_steps)

    @property
    def token_share(self) -> float:
        return min(1.0, self.tokens / self.max_tokens)

    @property
    def time_share(self) -> float:
        return min(1.0, self.elapsed_s / self.wall_clock_s)


@dataclass(frozen=True, slots=True)
class TaskSummary:
    task: TaskRecord
    budget: BudgetUse
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: float

    @property
    def goal(self) -> str:
        return str(self.task.spec.get("goal", ""))

    @property
    def roles(self) -> list[str]:
        return [str(role["name"]) for role in self.task.spec.get("roles", [])]

    @property
    def outcome(self) -> str | None:
        """The task's result or error without the success check's record, which `check` describes."""
        return without_outcome(self.task.error or self.task.result) or None

    @property
    def check(self) -> str | None:
        found = CheckOutcome.find(self.task.result) or CheckOutcome.find(self.task.error)
        return found.describe() if found is not None else None

    def as_json(self) -> JsonDict:
        task, budget = self.task, self.budget
        return {
            "task_id": task.task_id,
            "status": task.status.value,
            "goal": self.goal,
            "roles": self.roles,
            "owner": task.owner,
            "cancel_requested": task.cancel_requested,
            "created_at": task.created_at,
            "updated_at": task.updated_at,
            "result": task.result,
            "error": task.error,
            "check": self.check,
            "step_count": budget.steps,
            "budget": {
                "steps": budget.steps,
                "max_steps": budget.max_steps,
                "tokens": budget.tokens,
                "max_tokens": budget.max_tokens,
                "elapsed_s": round(budget.elapsed_s, 3),
                "wall_clock_s": budget.wall_clock_s,
            },
            "tokens": {
                "prompt": self.prompt_tokens,
                "cached": self.cached_tokens,
                "completion": self.completion_tokens,
            },
            "cost_usd": self.cost_usd,
        }


def summarize(task: TaskRecord, usages: Sequence[StepUsage], now: float | None = None) -> TaskSummary:
    """A task's budget use and cost from its steps' usage (a running task's clock runs to `now`)."""
    limits = Limits.model_validate(task.spec.get("limits", {}))
    prompt = sum(int(step.usage.get("prompt_tokens", 0)) for step in usages)
    cached = sum(int(step.usage.get("cached_tokens", 0)) for step in usages)
    completion = sum(int(step.usage.get("completion_tokens", 0)) for step in usages)
    end = task.updated_at if task.status.terminal else (now if now is not None else time.time())
    elapsed = max(0.0, end - usages[0].started_at) if usages else 0.0
    cost = cost_usd(Usage(prompt, min(cached, prompt), completion), PRICE)
    budget = BudgetUse(
        len(usages), limits.max_steps, prompt + completion, limits.max_tokens, elapsed, limits.wall_clock_s
    )
    return TaskSummary(task, budget, prompt, cached, completion, float(cost))


@dataclass(frozen=True, slots=True)
class CallView:
    index: int
    tool: str
    arguments: str  # pretty JSON, or the command/code itself for the sandbox tools
    output: str | None  # None: not observed yet (running, or the worker died during it)
    error: bool
    run_status: str | None  # the sandbox's status (ok, timeout, ...) for runs; None for other tools
    exit_code: int | None
    executions: int
    took_s: float | None

    @property
    def state(self) -> str:
        if self.output is None:
            return "pending"
        return "error" if self.error else "ok"


@dataclass(frozen=True, slots=True)
class StepView:
    step_no: int
    role: str
    epoch: int
    content: str
    committed: bool
    started_at: float
    model_s: float
    tools_s: float | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    messages_in: int
    calls: tuple[CallView, ...]
    resumed: bool  # a new lease began here without a hand-off: the task was resumed after a stop or crash
    handed_over: bool  # the previous step handed the task to this step's role
    loop_note: str | None

    def as_json(self) -> JsonDict:
        return {
            "step_no": self.step_no,
            "role": self.role,
            "epoch": self.epoch,
            "content": self.content,
            "status": "committed" if self.committed else "planned",
            "started_at": self.started_at,
            "model_s": round(self.model_s, 4),
            "tools_s": None if self.tools_s is None else round(self.tools_s, 4),
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens,
            },
            "resumed": self.resumed,
            "loop": self.loop_note,
            "tool_calls": [
                {
                    "tool": call.tool,
                    "arguments": call.arguments,
                    "output": call.output,
                    "state": call.state,
                    "run_status": call.run_status,
                    "exit_code": call.exit_code,
                    "executions": call.executions,
                    "took_s": call.took_s,
                }
                for call in self.calls
            ],
        }


def _arguments_text(call: ToolCallRecord) -> str:
    arguments = call.arguments
    if call.tool == "shell" and isinstance(arguments.get("command"), str) and len(arguments) == 1:
        return str(arguments["command"])
    if call.tool == "python" and isinstance(arguments.get("code"), str) and len(arguments) == 1:
        return str(arguments["code"])
    return json.dumps(arguments, ensure_ascii=False, indent=1)


def _call_view(call: ToolCallRecord, ran_from: float) -> CallView:
    observation = call.observation
    output = None if observation is None else str(observation.get("content", ""))
    status, exit_code = read_run(output or "")
    took = None if call.observed_at is None else max(0.0, call.observed_at - ran_from)
    return CallView(
        index=call.call_index,
        tool=call.tool,
        arguments=_arguments_text(call),
        output=output,
        error=bool(observation and observation.get("error")),
        run_status=status if call.tool in ("shell", "python") else None,
        exit_code=exit_code,
        executions=call.executions,
        took_s=took,
    )


def _handed_off(step: StepRecord) -> bool:
    return any(
        call.tool == "handoff" and call.observation is not None and not call.observation.get("error")
        for call in step.tool_calls
    )


def step_views(steps: Sequence[StepRecord], loop: LoopSpec) -> list[StepView]:
    """Every step as the timeline shows it; the loop marks and resumptions need the steps before each."""
    marks = loop_marks(list(steps), loop)
    views = []
    previous: StepRecord | None = None
    for step, mark in zip(steps, marks, strict=True):
        calls = []
        ran_from = step.model_done_at
        for call in step.tool_calls:
            view = _call_view(call, ran_from)
            calls.append(view)
            ran_from = call.observed_at or ran_from
        committed = step.status is StepStatus.COMMITTED
        handed_over = previous is not None and _handed_off(previous)
        views.append(
            StepView(
                step_no=step.step_no,
                role=step.role,
                epoch=step.epoch,
                content=str(step.message.get("content") or ""),
                committed=committed,
                started_at=step.started_at,
                model_s=max(0.0, step.model_done_at - step.started_at),
                tools_s=None
                if step.committed_at is None
                else max(0.0, step.committed_at - step.model_done_at),
                prompt_tokens=int(step.usage.get("prompt_tokens", 0)),
                cached_tokens=int(step.usage.get("cached_tokens", 0)),
                completion_tokens=int(step.usage.get("completion_tokens", 0)),
                messages_in=step.messages_in,
                calls=tuple(calls),
                resumed=previous is not None and step.epoch != previous.epoch and not handed_over,
                handed_over=handed_over,
                loop_note=mark.describe() if mark is not None and committed else None,
            )
        )
        previous = step
    return views


def task_loop(task: TaskRecord) -> LoopSpec:
    return LoopSpec.model_validate(task.spec.get("loop", {}))


def lookback(loop: LoopSpec) -> int:
    """How many steps before a page its views depend on: the step before (a resumption, a hand-off) and a
    run of repeats long enough to be marked (the task stops after repeats_before_nudge +
    nudges_before_stop of them, so no longer run is ever journaled)."""
    return loop.repeats_before_nudge + loop.nudges_before_stop + 1


def shown_steps(task: TaskRecord, steps: Sequence[StepRecord]) -> list[StepRecord]:
    """The steps a page shows as done: all of a finished task's; a running task's committed ones (its step
    in progress is in the summary until it commits, so a live page only ever appends)."""
    if task.status.terminal:
        return list(steps)
    return [step for step in steps if step.status is StepStatus.COMMITTED]


def pending_step(task: TaskRecord, steps: Sequence[StepRecord]) -> StepRecord | None:
    """The step a worker is in the middle of (its reply journaled, its tool calls not all done)."""
    if task.status.terminal or not steps or steps[-1].status is StepStatus.COMMITTED:
        return None
    return steps[-1]


@dataclass(frozen=True, slots=True)
class Timeline:
    summary: TaskSummary
    steps: list[StepView]  # the steps asked for, oldest first
    earlier: int  # how many done steps come before them
    shown: int  # how many steps are done (a running task's step in progress is not)
    pending: StepRecord | None


def read_summaries(journal: Journal, limit: int, status: TaskStatus | None) -> list[TaskSummary]:
    """The newest tasks with their budget use and cost: two queries, however many steps they have."""
    tasks = journal.list_tasks(limit, status)
    usage = journal.step_usage([task.task_id for task in tasks])
    return [summarize(task, usage[task.task_id]) for task in tasks]


def read_timeline(
    journal: Journal,
    task: TaskRecord,
    before: int | None = None,
    after: int | None = None,
    size: int = PAGE_STEPS,
) -> Timeline:
    """The `size` done steps before step `before` (the newest when None), or with `after` every done step
    from that one on (a live stream's new steps); reads those steps and the few their views look back on."""
    usage = journal.step_usage([task.task_id])[task.task_id]
    loop = task_loop(task)
    total = len(usage)
    # Read from one step earlier than the page could start: the newest step may be in progress.
    first = (
        after if after is not None else max(0, (total if before is None else min(before, total)) - size - 1)
    )
    steps = journal.steps(task.task_id, max(0, first - lookback(loop)))
    pending = pending_step(task, steps)
    shown = total - (pending is not None)
    if after is not None:
        start, end = after, shown
    else:
        end = shown if before is None else min(before, shown)
        start = max(0, end - size)
    views = [view for view in step_views(shown_steps(task, steps), loop) if start <= view.step_no < end]
    return Timeline(summarize(task, usage), views, start, shown, pending)
