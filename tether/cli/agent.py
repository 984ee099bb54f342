"""`tether agent ...`: submit, follow, inspect, resume and cancel durable agent tasks; the step benchmark."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tether.agents.roles import select_roles
from tether.agents.task import TaskSpec, build_task_spec, load_task_file
from tether.agents.timeline import step_lines, task_line
from tether.cli.common import CliState, print_json, state, user_errors
from tether.cli.worker import (
    ArtifactsOption,
    BaseUrlOption,
    BusNameOption,
    BusOption,
    HomeOption,
    Locations,
    ModelOption,
    StoreOption,
    TablePrefixOption,
    run_worker,
)
from tether.errors import ConfigError
from tether.store.records import TaskRecord, TaskStatus

if TYPE_CHECKING:
    from tether.agents.service import AgentsConfig
    from tether.store.journal import Journal

app = typer.Typer(help="Durable long-horizon agents: tasks, steps, resume.", no_args_is_help=True)
console = Console(soft_wrap=True)  # timeline lines stay one line each, even when piped
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]
RolesOption = Annotated[
    str | None, typer.Option("--roles", help="Role team, e.g. planner,coder,reviewer (default: one agent).")
]
MaxStepsOption = Annotated[
    int | None,
    typer.Option("--max-steps", min=1, help="Step budget of the task (default 50, or the task file's)."),
]
TaskFileOption = Annotated[
    Path | None,
    typer.Option(
        "--task-file", help="YAML/JSON task template: roles (personas, tools, hand-offs), limits, ..."
    ),
]
RequireFinishOption = Annotated[
    bool,
    typer.Option(
        "--require-finish/--plain-reply-ends",
        help="Only `finish` ends the task (a chatty reply is nudged to act), or any reply without tools.",
    ),
]


def _config(ctx: typer.Context, locations: Locations) -> AgentsConfig:
    return locations.config(state(ctx))


def _spec(
    goal: str,
    roles: str | None,
    max_steps: int | None,
    files: list[Path],
    require_finish: bool,
    task_file: Path | None,
) -> TaskSpec:
    """The task file (if any) is the template; the goal and any flag given override it."""
    data: dict[str, Any] = load_task_file(task_file) if task_file else {}
    data["goal"] = goal
    data["require_finish"] = require_finish
    if roles:
        data["roles"] = [role.model_dump() for role in select_roles(roles)]
    if max_steps is not None:
        data["limits"] = {**data.get("limits", {}), "max_steps": max_steps}
    for path in files:
        if not path.is_file():
            raise ConfigError(f"--file {str(path)!r} does not exist")
        data.setdefault("files", {})[path.name] = path.read_text()
    return build_task_spec(data, str(task_file) if task_file else "task")


def _summary(task: TaskRecord, steps: int) -> dict[str, object]:
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
    }


async def _submit(config: AgentsConfig, spec: TaskSpec) -> str:
    from tether.agents.service import AgentStack

    stack = AgentStack(config)
    try:
        return await stack.submit(spec)
    finally:
        await stack.close()


def _print_new_steps(journal: Journal, task_id: str, printed: dict[int, int]) -> TaskRecord:
    """Print steps and tool calls not printed yet (a step's lines grow as its calls finish)."""
    for step in journal.steps(task_id, from_step=max(printed, default=0)):
        lines = step_lines(step)
        for line in lines[printed.get(step.step_no, 0) :]:
            console.print(line, highlight=False, markup=False)
        printed[step.step_no] = len(lines) if step.committed_at is not None else 1
    return journal.get_task(task_id)


async def _follow(journal: Journal, task_id: str, poll_s: float = 0.5) -> TaskRecord:
    printed: dict[int, int] = {}
    while True:
        task = _print_new_steps(journal, task_id, printed)
        if task.status.terminal:
            _print_new_steps(journal, task_id, printed)
            console.print(task_line(task), highlight=False, markup=False)
            return task
        await asyncio.sleep(poll_s)


@app.command("run")
def run_command(
    ctx: typer.Context,
    goal: Annotated[str, typer.Argument(help="What the agent should achieve.")],
    roles: RolesOption = None,
    model: ModelOption = "smollm2-135m-instruct",
    base_url: BaseUrlOption = None,
    max_steps: MaxStepsOption = None,
    require_finish: RequireFinishOption = True,
    task_file: TaskFileOption = None,
    file: Annotated[list[Path], typer.Option("--file", help="Put this file in the workdir at start.")] = [],  # noqa: B006
    home: HomeOption = None,
    store: StoreOption = None,
    bus: BusOption = None,
    bus_name: BusNameOption = "tether-tasks",
    table_prefix: TablePrefixOption = "agent_",
    artifacts: ArtifactsOption = None,
) -> None:
    """Submit a task and run it here with an in-process worker, printing its timeline as it goes."""
    cli = state(ctx)
    with user_errors():
        config = _config(ctx, Locations(home, store, bus, bus_name, artifacts, table_prefix))
        spec = _spec(goal, roles, max_steps, file, require_finish, task_file)
        task = asyncio.run(_run_and_follow(cli, config, spec, model, base_url))
    if task.status is not TaskStatus.SUCCEEDED:
        raise typer.Exit(1)


async def _run_and_follow(
    cli: CliState, config: AgentsConfig, spec: TaskSpec, model: str | None, base_url: str | None
) -> TaskRecord:
    from tether.agents.worker import WorkerConfig
    from tether.store.journal import Journal

    task_id = await _submit(config, spec)
    console.print(
        f"task {task_id} submitted; resume it with `tether agent resume {task_id}`", highlight=False
    )
    stop = asyncio.Event()
    worker = asyncio.create_task(
        run_worker(cli, config, model, base_url, WorkerConfig(max_in_flight=1), stop)
    )
    journal = Journal(config.store_url, table_prefix=config.table_prefix)
    try:
        follower = asyncio.create_task(_follow(journal, task_id))
        done, _ = await asyncio.wait({worker, follower}, return_when=asyncio.FIRST_COMPLETED)
        if worker in done:
            worker.result()  # a worker that failed to start raises here, with its message
        return await follower
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await worker
        journal.close()


@app.command("submit")
def submit_command(
    ctx: typer.Context,
    goal: Annotated[str, typer.Argument(help="What the agent should achieve.")],
    roles: RolesOption = None,
    max_steps: MaxStepsOption = None,
    require_finish: RequireFinishOption = True,
    task_file: TaskFileOption = None,
    file: Annotated[list[Path], typer.Option("--file", help="Put this file in the workdir at start.")] = [],  # noqa: B006
    home: HomeOption = None,
    store: StoreOption = None,
    bus: BusOption = None,
    bus_name: BusNameOption = "tether-tasks",
    table_prefix: TablePrefixOption = "agent_",
    artifacts: ArtifactsOption = None,
) -> None:
    """Queue a task for `tether worker`s and print its id."""
    with user_errors():
        config = _config(ctx, Locations(home, store, bus, bus_name, artifacts, table_prefix))
        task_id = asyncio.run(_submit(config, _spec(goal, roles, max_steps, file, require_finish, task_file)))
    print(task_id)


def _journal(ctx: typer.Context, home: Path | None, store: str | None, table_prefix: str) -> Journal:
    from tether.store.journal import Journal

    config = _config(ctx, Locations(home, store, None, "tether-tasks", None, table_prefix))
    return Journal(config.store_url, table_prefix=config.table_prefix)


@app.command("ls")
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
        journal = _journal(ctx, home, store, table_prefix)
        tasks = [(task, len(journal.steps(task.task_id))) for task in journal.list_tasks(limit, wanted)]
        journal.close()
    if as_json:
        print_json([_summary(task, steps) for task, steps in tasks])
        return
    table = Table("task", "status", "steps", "goal", "updated")
    for task, steps in tasks:
        updated = time.strftime("%H:%M:%S", time.localtime(task.updated_at))
        table.add_row(
            task.task_id, task.status.value, str(steps), str(task.spec.get("goal", ""))[:60], updated
        )
    console.print(table)


@app.command("show")
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
        journal = _journal(ctx, home, store, table_prefix)
        task = journal.get_task(task_id)
        steps = journal.steps(task_id)
        journal.close()
    if as_json:
        print_json(
            {**_summary(task, len(steps)), "spec": task.spec, "steps": [asdict(step) for step in steps]}
        )
        return
    table = Table(title=f"task {task_id}", show_header=False)
    for key, value in _summary(task, len(steps)).items():
        table.add_row(key, json.dumps(value) if isinstance(value, list) else str(value))
    console.print(table)


@app.command("logs")
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
    """The task's timeline: each step's model reply and each tool call with its result."""
    with user_errors():
        journal = _journal(ctx, home, store, table_prefix)
        try:
            if follow:
                asyncio.run(_follow(journal, task_id))
            else:
                console.print(
                    task_line(_print_new_steps(journal, task_id, {})), highlight=False, markup=False
                )
        finally:
            journal.close()


async def _resume(config: AgentsConfig, task_id: str) -> None:
    from tether.agents.service import AgentStack

    stack = AgentStack(config)
    try:
        await stack.resume(task_id)
    finally:
        await stack.close()


@app.command("resume")
def resume_command(
    ctx: typer.Context,
    task_id: Annotated[str, typer.Argument(help="Task id.")],
    home: HomeOption = None,
    store: StoreOption = None,
    bus: BusOption = None,
    bus_name: BusNameOption = "tether-tasks",
    table_prefix: TablePrefixOption = "agent_",
    artifacts: ArtifactsOption = None,
) -> None:
    """Queue a stopped task again; a worker continues it from its last committed step."""
    from tether.store.journal import Journal

    with user_errors():
        config = _config(ctx, Locations(home, store, bus, bus_name, artifacts, table_prefix))
        journal = Journal(config.store_url, table_prefix=config.table_prefix)
        task = journal.get_task(task_id)
        journal.close()
        if task.status is TaskStatus.SUCCEEDED:
            raise ConfigError(f"task {task_id} already succeeded; nothing to resume")
        asyncio.run(_resume(config, task_id))
    print(task_id)


@app.command("cancel")
def cancel_command(
    ctx: typer.Context,
    task_id: Annotated[str, typer.Argument(help="Task id.")],
    home: HomeOption = None,
    store: StoreOption = None,
    table_prefix: TablePrefixOption = "agent_",
) -> None:
    """Cancel a task: at once if no worker holds it, else before its next step."""
    with user_errors():
        journal = _journal(ctx, home, store, table_prefix)
        task = journal.request_cancel(task_id)
        journal.close()
    print(f"{task_id} {task.status.value}" + (" (cancel requested)" if not task.status.terminal else ""))


@app.command("bench")
def bench_command(
    steps: Annotated[int, typer.Option("--steps", min=10, help="Steps persisted.")] = 500,
    store: Annotated[
        str | None, typer.Option("--store", help="Journal to measure (default: a fresh SQLite file).")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Checkpoint overhead: milliseconds to persist one step (append + commit), median and p95."""
    from tether.agents.bench import bench_step_persist
    from tether.store.journal import Journal

    with user_errors(), tempfile.TemporaryDirectory() as scratch:
        url = store or f"sqlite:///{Path(scratch) / 'bench.db'}"
        journal = Journal(url, table_prefix=f"bench{int(time.time())}_")
        try:
            result = bench_step_persist(journal, steps)
        finally:
            journal.drop_schema()
            journal.close()
    if as_json:
        print_json({"store": url.split("://", 1)[0], **asdict(result)})
        return
    console.print(
        f"persisting a step ({result.tool_calls_per_step} tool calls) on {url.split('://', 1)[0]}: "
        f"median {result.step_median_ms:.2f} ms, p95 {result.step_p95_ms:.2f} ms "
        f"(append {result.append_median_ms:.2f} ms + commit {result.commit_median_ms:.2f} ms, "
        f"{result.steps} steps)",
        highlight=False,
    )
