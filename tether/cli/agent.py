"""`tether agent ...`: submit, follow, inspect, resume and cancel durable agent tasks; the step benchmark."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.table import Table

from tether.agents.loops import last_mark
from tether.agents.replay import spent_budget
from tether.agents.roles import select_roles
from tether.agents.task import TaskSpec, build_task_spec, load_task_file
from tether.agents.timeline import task_line, timeline_lines
from tether.cli.common import (
    CliState,
    DeviceOption,
    DTypeOption,
    err_console,
    print_json,
    state,
    user_errors,
)
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
    stop_on_interrupt,
)
from tether.errors import ConfigError
from tether.store.records import StepRecord, TaskRecord, TaskStatus

if TYPE_CHECKING:
    from tether.agents.model import ChatModel
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
    """Print steps, tool calls and nudges not printed yet: a step's line when it starts, its calls with
    their results (and any nudge) once it is committed.

    Every step is read again each time: a step's loop mark depends on the steps before it."""
    task = journal.get_task(task_id)
    steps = journal.steps(task_id)
    for step, lines in zip(steps, timeline_lines(steps, task.spec), strict=True):
        shown = lines if step.committed_at is not None else lines[:1]
        for line in shown[printed.get(step.step_no, 0) :]:
            console.print(line, highlight=False, markup=False)
        printed[step.step_no] = len(shown)
    return journal.get_task(task_id)


async def _follow(journal: Journal, task_id: str, printed: dict[int, int], poll_s: float = 0.5) -> TaskRecord:
    while True:
        task = _print_new_steps(journal, task_id, printed)
        if task.status.terminal:
            _print_new_steps(journal, task_id, printed)
            console.print(task_line(task), highlight=False, markup=False)
            return task
        await asyncio.sleep(poll_s)


def _open_model(cli: CliState, model: str | None, base_url: str | None, device: str, dtype: str) -> ChatModel:
    """Loaded before the timeline starts, so whatever loading prints comes before it, not inside it."""
    if base_url is None and model is not None and not model.startswith("scripted:"):
        err_console.print(f"loading model {model} ...", highlight=False, soft_wrap=True)
    from tether.agents.model import open_model

    return open_model(model, base_url, cli.settings().cache_dir, device=device, dtype=dtype)


def _stopped_line(task: TaskRecord, steps: list[StepRecord]) -> str:
    committed = sum(step.committed_at is not None for step in steps)
    where = f"after step {committed - 1}" if committed else "before its first step"
    return (
        f"stopped {where}: task {task.task_id} is {task.status.value} with its {committed} committed "
        f"step(s) in the journal; continue it with `tether agent resume {task.task_id} --run` "
        "or a `tether worker`"
    )


def _work_and_follow(cli: CliState, config: AgentsConfig, task_id: str, model: ChatModel) -> TaskRecord:
    """Run an in-process worker and print the task's timeline until the task ends.

    Ctrl-C stops the task after its current step (queued, resumable); a second Ctrl-C stops at once,
    mid-step (equally resumable: the journal holds the step's intent). Both exit 130."""
    from tether.agents.worker import WorkerConfig
    from tether.store.journal import Journal

    async def main() -> TaskRecord:
        stop = asyncio.Event()
        stop_on_interrupt(stop, "interrupted: stopping after the current step (Ctrl-C again to stop at once)")
        journal = Journal(config.store_url, table_prefix=config.table_prefix)
        worker = asyncio.create_task(run_worker(cli, config, model, WorkerConfig(max_in_flight=1), stop))
        printed: dict[int, int] = {}
        follower = asyncio.create_task(_follow(journal, task_id, printed))
        try:
            done, _ = await asyncio.wait({worker, follower}, return_when=asyncio.FIRST_COMPLETED)
            if follower in done:
                return follower.result()
            worker.result()  # a worker that failed to start raises here, with its message
            follower.cancel()  # the worker stopped between steps: the task will not end here
            return _print_new_steps(journal, task_id, printed)
        except asyncio.CancelledError:
            worker.cancel()
            raise
        finally:
            stop.set()
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
            journal.close()
            await model.close()

    try:
        task = asyncio.run(main())
    except asyncio.CancelledError:
        err_console.print(
            f"stopped at once: task {task_id} resumes from its journal (the interrupted step is finished "
            f"first) with `tether agent resume {task_id} --run` or a `tether worker`",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(130) from None
    if not task.status.terminal:
        journal = Journal(config.store_url, table_prefix=config.table_prefix)
        try:
            err_console.print(_stopped_line(task, journal.steps(task_id)), highlight=False, soft_wrap=True)
        finally:
            journal.close()
        raise typer.Exit(130)
    return task


@app.command("run")
def run_command(
    ctx: typer.Context,
    goal: Annotated[str, typer.Argument(help="What the agent should achieve.")],
    roles: RolesOption = None,
    model: ModelOption = "smollm2-135m-instruct",
    base_url: BaseUrlOption = None,
    device: DeviceOption = "auto",
    dtype: DTypeOption = "float32",
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
    """Submit a task and run it here with an in-process worker, printing its timeline as it goes.

    Ctrl-C stops it after the current step, resumable; Ctrl-C twice stops at once."""
    cli = state(ctx)
    with user_errors():
        config = _config(ctx, Locations(home, store, bus, bus_name, artifacts, table_prefix))
        spec = _spec(goal, roles, max_steps, file, require_finish, task_file)
        chat_model = _open_model(cli, model, base_url, device, dtype)
        task_id = asyncio.run(_submit(config, spec))
        console.print(
            f"task {task_id} submitted; resume it with `tether agent resume {task_id}`", highlight=False
        )
        task = _work_and_follow(cli, config, task_id, chat_model)
    if task.status is not TaskStatus.SUCCEEDED:
        raise typer.Exit(1)


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


def _readable_journal(config: AgentsConfig) -> Journal | None:
    """The journal to read, or None where none was ever created. Reading does not create one: a mistyped
    --home would otherwise leave an empty store behind and look like a machine without tasks."""
    from tether.store.journal import Journal, journal_exists

    if not journal_exists(config.store_url):
        return None
    return Journal(config.store_url, table_prefix=config.table_prefix)


def _missing_journal(config: AgentsConfig) -> str:
    """Only an SQLite journal can be missing: it names the file."""
    from tether.store.journal import sqlite_path

    return (
        f"the journal {sqlite_path(config.store_url)} does not exist yet "
        "(no task was submitted with this --home/--store)"
    )


def _task_journal(config: AgentsConfig, task_id: str) -> Journal:
    """The journal to look `task_id` up in; without any journal, a clear error naming both (an id the
    journal lacks is the same error, from `Journal.get_task`)."""
    from tether.store.journal import UnknownTask

    journal = _readable_journal(config)
    if journal is None:
        raise UnknownTask(f"no task {task_id!r}: {_missing_journal(config)}")
    return journal


def _read_config(ctx: typer.Context, home: Path | None, store: str | None, table_prefix: str) -> AgentsConfig:
    return _config(ctx, Locations(home, store, None, "tether-tasks", None, table_prefix))


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(ts))


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
        config = _read_config(ctx, home, store, table_prefix)
        journal = _readable_journal(config)
        tasks = []
        if journal is not None:
            try:
                found = journal.list_tasks(limit, wanted)
                tasks = [(task, len(journal.steps(task.task_id))) for task in found]
            finally:
                journal.close()
    if as_json:
        print_json([_summary(task, steps) for task, steps in tasks])
        return
    if not tasks:
        where = _missing_journal(config) if journal is None else f"the journal at {config.store_url}"
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
        journal = _task_journal(_read_config(ctx, home, store, table_prefix), task_id)
        try:
            task = journal.get_task(task_id)
            steps = journal.steps(task_id)
        finally:
            journal.close()
    if as_json:
        print_json(
            {**_summary(task, len(steps)), "spec": task.spec, "steps": [asdict(step) for step in steps]}
        )
        return
    table = Table(title=f"task {task_id}", show_header=False)
    for key, value in _summary(task, len(steps)).items():
        if key in ("created_at", "updated_at") and isinstance(value, float):
            value = _when(value)
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
    """The task's timeline: each step's model reply, each tool call with its result, each loop nudge."""
    with user_errors():
        journal = _task_journal(_read_config(ctx, home, store, table_prefix), task_id)
        try:
            if follow:
                asyncio.run(_follow(journal, task_id, {}))
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


def _cannot_continue(task: TaskRecord, steps: list[StepRecord]) -> str | None:
    """Why a worker would end the task again before its next step (a spent budget, a loop stop)."""
    spec = TaskSpec.model_validate(task.spec)
    elapsed_s = time.time() - steps[0].started_at if steps else 0.0
    spent = spent_budget(spec.limits, steps, elapsed_s)
    if spent is not None:
        return spent
    loop = last_mark(steps, spec.loop)
    return loop.describe() if loop is not None and loop.stop else None


@app.command("resume")
def resume_command(
    ctx: typer.Context,
    task_id: Annotated[str, typer.Argument(help="Task id.")],
    run: Annotated[
        bool, typer.Option("--run", help="Run it here with an in-process worker and print its timeline.")
    ] = False,
    model: ModelOption = "smollm2-135m-instruct",
    base_url: BaseUrlOption = None,
    device: DeviceOption = "auto",
    dtype: DTypeOption = "float32",
    home: HomeOption = None,
    store: StoreOption = None,
    bus: BusOption = None,
    bus_name: BusNameOption = "tether-tasks",
    table_prefix: TablePrefixOption = "agent_",
    artifacts: ArtifactsOption = None,
) -> None:
    """Queue a stopped task again; a worker (or --run, here) continues it from its last committed step."""
    cli = state(ctx)
    with user_errors():
        config = _config(ctx, Locations(home, store, bus, bus_name, artifacts, table_prefix))
        journal = _task_journal(config, task_id)
        try:
            task = journal.get_task(task_id)
            steps = journal.steps(task_id)
        finally:
            journal.close()
        if task.status is TaskStatus.SUCCEEDED:
            raise ConfigError(f"task {task_id} already succeeded; nothing to resume")
        blocked = _cannot_continue(task, steps)
        if blocked is not None:
            raise ConfigError(
                f"task {task_id} cannot continue, {blocked}; nothing was queued (a worker would end it "
                "again at once). Submit the goal again with a larger budget or other settings "
                "(--max-steps, or limits and loop in a --task-file)"
            )
        chat_model = _open_model(cli, model, base_url, device, dtype) if run else None
        asyncio.run(_resume(config, task_id))
        print(task_id, flush=True)  # before the notes on stderr, even when both go to one log
        if chat_model is None:
            err_console.print(
                f"queued to continue from step {len(steps)}; it runs when a worker takes it: start "
                "`tether worker` with the same --home/--store/--bus, or resume with --run to run it here",
                highlight=False,
                soft_wrap=True,
            )
            return
        task = _work_and_follow(cli, config, task_id, chat_model)
    if task.status is not TaskStatus.SUCCEEDED:
        raise typer.Exit(1)


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
        journal = _task_journal(_read_config(ctx, home, store, table_prefix), task_id)
        try:
            task = journal.request_cancel(task_id)
        finally:
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
