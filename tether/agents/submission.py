"""How a task is asked for and when it may go on, shared by `tether agent submit/run/resume` and the
console: a goal with a role team and a step budget (over a task-file template), a family's seeded task,
and why a stopped task would be ended again at once if it were resumed. Pure: no journal, no queue."""

from __future__ import annotations

import time
from typing import Any

from tether.agents.loops import last_mark
from tether.agents.replay import spent_budget
from tether.agents.roles import select_roles
from tether.agents.task import TaskSpec, build_task_spec
from tether.store.records import StepRecord, TaskRecord, TaskStatus


def goal_spec(
    goal: str,
    roles: str | None = None,
    max_steps: int | None = None,
    require_finish: bool = True,
    template: dict[str, Any] | None = None,
    files: dict[str, str] | None = None,
    source: str = "task",
) -> TaskSpec:
    """The template (a task file's fields, if any) with the goal and each setting given laid over it."""
    data: dict[str, Any] = dict(template or {})
    data["goal"] = goal
    data["require_finish"] = require_finish
    if roles:
        data["roles"] = [role.model_dump() for role in select_roles(roles)]
    if max_steps is not None:
        data["limits"] = {**data.get("limits", {}), "max_steps": max_steps}
    for name, text in (files or {}).items():
        data.setdefault("files", {})[name] = text
    return build_task_spec(data, source)


def family_task(name: str, seed: int, max_steps: int | None = None) -> TaskSpec:
    """Task `seed` of the family `name` (its goal, files, tools and check), with its default budget unless
    `max_steps` is given."""
    from tether.agents.families import MAX_STEPS, family

    return family(name).task(seed, max_steps or MAX_STEPS)


def resume_refusal(task: TaskRecord, steps: list[StepRecord], now: float | None = None) -> str | None:
    """Why queueing `task` again would do nothing useful (it succeeded, or a worker would end it again
    before its next step: a spent budget, a loop stop); None when it may resume."""
    if task.status is TaskStatus.SUCCEEDED:
        return f"task {task.task_id} already succeeded; nothing to resume"
    spec = TaskSpec.model_validate(task.spec)
    elapsed_s = (now if now is not None else time.time()) - steps[0].started_at if steps else 0.0
    blocked = spent_budget(spec.limits, steps, elapsed_s)
    if blocked is None:
        loop = last_mark(steps, spec.loop)
        blocked = loop.describe() if loop is not None and loop.stop else None
    if blocked is None:
        return None
    return (
        f"task {task.task_id} cannot continue, {blocked}; nothing was queued (a worker would end it "
        "again at once). Submit the goal again with a larger budget or other settings "
        "(--max-steps, or limits and loop in a --task-file)"
    )
