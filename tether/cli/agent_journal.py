"""Reading the agents' journal: `tether agent ls`, `show` and `logs`. Reading never creates a journal, so a
mistyped --home reports that nothing is there instead of leaving an empty store behind."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
import yaml
from rich.table import Table

from tether.agents.check import CheckOutcome
from tether.agents.timeline import task_line, timeline_lines
from tether.cli.agent_follow import console, print_new_steps
from tether.cli.agent_follow import follow as follow_task
from tether.cli.common import err_console, print_json, state, user_errors
from tether.cli.worker import HomeOption, Locations, StoreOption, TablePrefixOption
from tether.errors import ConfigError
from tether.store.records import TaskRecord, TaskStatus

if TYPE_CHECKING:
    from tether.agents.service import AgentsConfig
    from tether.store.journal import Journal

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def read_config(ctx: typer.Context, home: Path | None, store: str | None, table_prefix: str) -> AgentsConfig:
    return Locations(home, store, None, "tether-tasks", None, table_prefix).config(state(ctx))


def summary(task: TaskRecord, steps: int) -> dict[str, object]:
    return {
        "task_id": task.task_id,
        "status": task.status.value,
        "step_count": steps,
        "goal": task.spec.get("goal"),
        "roles": [role["name"] for role in task.spec.get("roles", [])],
        "created_at": task.created_at,
        "updated_at": task.updated_at,
        "owner": task.owner,
        "result": task.result,
        "error": task.error,
        "check": describe_check(task),
    }


def describe_check(task: TaskRecord) -> str | None:
    """How the task's success check went, when it has one and it ran."""
    outcome = CheckOutcome.find(task.result) or CheckOutcome.find(task.error)
    return outcome.describe() if outcome is not None else None


def readable_journal(config: AgentsConfig) -> Journal | None:
    """The journal to read, or None where none was ever created. Reading does not create one: a mistyped
    --home would otherwise leave an empty store behind and look like a machine without tasks."""
    from tether.store.database import journal_exists
    from tether.store.journal import Journal

    if not journal_exists(config.store_url):
        return None
    return Journal(config.store_url, table_prefix=config.table_prefix)


def missing_journal(config: AgentsConfig) -> str:
    """Only an SQLite journal can be missing: it names the file."""
    from tether.store.database import sqlite_path

    return (
        f"the journal {sqlite_path(config.store_url)} does not exist yet "
        "(no task was submitted with this --home/--store)"
    )


def task_journal(config: AgentsConfig, task_id: str) -> Journal:
    """The journal to look `task_id` up in; without any journal, a clear error naming both (an id the
    journal lacks is the same error, from `Journal.get_task`)."""
    from tether.store.journal import UnknownTask

    journal = readable_journal(config)
    if journal is None:
        raise UnknownTask(f"no task {task_id!r}: {missing_journal(config)}")
    return journal


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(ts))


def ls_command(
    ctx: typer.Context,
    status: Annotated[str | None, typer.Option("--status", help="Only tasks in this state.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="Newest tasks shown.")] = 50,
    as_json: JsonOption = False,
    home: HomeOption = None,
    store: StoreOption = None,
    table_prefix: TablePrefixOption = "agent_",
) -> None:
    """List tasks, newest first."""
    with user_errors():
        wanted = None
        if status is not None:
            if status not in {s.value for s in TaskStatus}:
                raise ConfigError(f"--status {status!r}: use one of {', '.join(s.value for s in TaskStatus)}")
            wanted = TaskStatus(status)
        config = read_config(ctx, home, store, table_prefix)
        journal = readable_journal(config)
        tasks = []
        if journal is not None:
            try:
                found = journal.list_tasks(limit, wanted)
                usage = journal.step_usage([task.task_id for task in found])  # one query, not one a task
                tasks = [(task, len(usage[task.task_id])) for task in found]
            finally:
                journal.close()
    if as_json:
        print_json([summary(task, steps) for task, steps in tasks])
        return
    if not tasks:
        where = missing_journal(config) if journal is None else f"the journal at {config.store_url}"
        err_console.print(
            f"no {status + ' ' if status else ''}tasks: looked in {where}", highlight=False, soft_wrap=True
        )
        return
    table = Table("task", "status", "steps", "goal", "updated")
    for task, steps in tasks:
        updated = time.strftime("%H:%M:%S", time.localtime(task.updated_at))
        table.add_row(
            task.task_id, task.status.value, str(steps), str(task.spec.get("goal", ""))[:60], updated
        )
    console.print(table)


def show_command(
    ctx: typer.Context,
    task_id: Annotated[str, typer.Argument(help="Task id.")],
    as_json: JsonOption = False,
    home: HomeOption = None,
    store: StoreOption = None,
    table_prefix: TablePrefixOption = "agent_",
) -> None:
    """A task's state, its spec and its steps (with --json: every step and tool call in full)."""
    with user_errors():
        journal = task_journal(read_config(ctx, home, store, table_prefix), task_id)
        try:
            task = journal.get_task(task_id)
            steps = journal.steps(task_id)
        finally:
            journal.close()
    if as_json:
        print_json(
            {**summary(task, len(steps)), "spec": task.spec, "steps": [asdict(step) for step in steps]}
        )
        return
    table = Table(title=f"task {task_id}", show_header=False)
    for key, value in summary(task, len(steps)).items():
        if key in ("created_at", "updated_at") and isinstance(value, float):
            value = when(value)
        if key != "task_id" and value is not None:
            table.add_row(key, ", ".join(map(str, value)) if isinstance(value, list) else str(value))
    table.add_row("took", f"{task.updated_at - task.created_at:.1f} s")
    console.print(table)
    spec = {key: value for key, value in task.spec.items() if key != "goal"}
    console.print("spec:", highlight=False)
    console.print(yaml.safe_dump(spec, sort_keys=False).rstrip(), highlight=False, markup=False)
    console.print(f"steps ({len(steps)}):", highlight=False)
    for lines in timeline_lines(steps, task.spec):
        for line in lines:
            console.print(line, highlight=False, markup=False)


def logs_command(
    ctx: typer.Context,
    task_id: Annotated[str, typer.Argument(help="Task id.")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing until the task ends.")
    ] = False,
    home: HomeOption = None,
    store: StoreOption = None,
    table_prefix: TablePrefixOption = "agent_",
) -> None:
    """The task's timeline: each step's model reply, each tool call with its result, each loop nudge."""
    with user_errors():
        journal = task_journal(read_config(ctx, home, store, table_prefix), task_id)
        try:
            if follow:
                asyncio.run(follow_task(journal, task_id, {}))
            else:
                console.print(task_line(print_new_steps(journal, task_id, {})), highlight=False, markup=False)
        finally:
            journal.close()
