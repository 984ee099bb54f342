"""`tether agent ...`: submit, run, resume and cancel durable agent tasks, and the step benchmark; reading
the journal (`ls`, `show`, `logs`) is `agent_journal.py`, running a task here `agent_follow.py`."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tether.agents.submission import family_task, goal_spec, resume_refusal
from tether.agents.task import TaskSpec, load_task_file
from tether.cli.agent_follow import console, open_model_client, work_and_follow
from tether.cli.agent_journal import (
    JsonOption,
    logs_command,
    ls_command,
    read_config,
    show_command,
    task_journal,
)
from tether.cli.common import (
    CliState,
    DeviceOption,
    DTypeOption,
    KvCacheMibOption,
    MaxModelLenOption,
    RopeScalingOption,
    err_console,
    open_sandbox,
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
)
from tether.errors import ConfigError
from tether.machine import warn_if_busy
from tether.store.records import TaskStatus

if TYPE_CHECKING:
    from tether.agents.long_session import LongSessionResult
    from tether.agents.service import AgentsConfig

app = typer.Typer(help="Durable long-horizon agents: tasks, steps, resume.", no_args_is_help=True)
app.command("ls")(ls_command)
app.command("show")(show_command)
app.command("logs")(logs_command)
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


FamilyOption = Annotated[
    str | None,
    typer.Option(
        "--family",
        help="Run a task of this agent task family (agent/shell, agent/ledger, ...) instead of a goal.",
    ),
]
SeedOption = Annotated[int, typer.Option("--seed", min=0, help="With --family: which task of the family.")]


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
    template = load_task_file(task_file) if task_file else {}
    for path in files:
        if not path.is_file():
            raise ConfigError(f"--file {str(path)!r} does not exist")
    return goal_spec(
        goal,
        roles,
        max_steps,
        require_finish,
        template,
        {path.name: path.read_text() for path in files},
        str(task_file) if task_file else "task",
    )


def _family_spec(name: str, seed: int, max_steps: int | None, given: Mapping[str, object]) -> TaskSpec:
    """A family's task (its goal, files, tools and check); the options that would change it are refused."""
    clashing = [flag for flag, value in given.items() if value]
    if clashing:
        raise ConfigError(f"--family {name} sets the whole task: drop {', '.join(clashing)}")
    return family_task(name, seed, max_steps)


async def _submit(config: AgentsConfig, spec: TaskSpec) -> str:
    from tether.agents.service import AgentStack

    stack = AgentStack(config)
    try:
        return await stack.submit(spec)
    finally:
        await stack.close()


@app.command("run")
def run_command(
    ctx: typer.Context,
    goal: Annotated[str | None, typer.Argument(help="What the agent should achieve (or --family).")] = None,
    family: FamilyOption = None,
    seed: SeedOption = 0,
    roles: RolesOption = None,
    model: ModelOption = "smollm2-135m-instruct",
    base_url: BaseUrlOption = None,
    device: DeviceOption = "auto",
    dtype: DTypeOption = "float32",
    kv_cache_mib: KvCacheMibOption = 256,
    max_model_len: MaxModelLenOption = None,
    rope_scaling: RopeScalingOption = None,
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
        if family is not None:
            given = {"a goal": goal, "--roles": roles, "--file": file, "--task-file": task_file}
            spec = _family_spec(family, seed, max_steps, given)
        elif goal is None:
            raise ConfigError("give the task's goal, or --family NAME [--seed N] for a task of a family")
        else:
            spec = _spec(goal, roles, max_steps, file, require_finish, task_file)
        chat_model = open_model_client(
            cli, model, base_url, device, dtype, kv_cache_mib, max_model_len, rope_scaling
        )
        task_id = asyncio.run(_submit(config, spec))
        console.print(
            f"task {task_id} submitted; resume it with `tether agent resume {task_id}`", highlight=False
        )
        task = work_and_follow(cli, config, task_id, chat_model)
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
    run: Annotated[
        bool, typer.Option("--run", help="Run it here with an in-process worker and print its timeline.")
    ] = False,
    model: ModelOption = "smollm2-135m-instruct",
    base_url: BaseUrlOption = None,
    device: DeviceOption = "auto",
    dtype: DTypeOption = "float32",
    kv_cache_mib: KvCacheMibOption = 256,
    max_model_len: MaxModelLenOption = None,
    rope_scaling: RopeScalingOption = None,
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
        journal = task_journal(config, task_id)
        try:
            task = journal.get_task(task_id)
            steps = journal.steps(task_id)
        finally:
            journal.close()
        refusal = resume_refusal(task, steps)
        if refusal is not None:
            raise ConfigError(refusal)
        chat_model = None
        if run:
            chat_model = open_model_client(
                cli, model, base_url, device, dtype, kv_cache_mib, max_model_len, rope_scaling
            )
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
        task = work_and_follow(cli, config, task_id, chat_model)
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
        journal = task_journal(read_config(ctx, home, store, table_prefix), task_id)
        try:
            task = journal.request_cancel(task_id)
        finally:
            journal.close()
    print(f"{task_id} {task.status.value}" + (" (cancel requested)" if not task.status.terminal else ""))


@app.command("bench")
def bench_command(
    ctx: typer.Context,
    steps: Annotated[
        int | None,
        typer.Option(
            "--steps", min=10, help="Steps persisted (default 500), or with --long-session run (200)."
        ),
    ] = None,
    store: Annotated[
        str | None, typer.Option("--store", help="Journal to measure (default: a fresh SQLite file).")
    ] = None,
    long_session: Annotated[
        bool,
        typer.Option(
            "--long-session",
            help="Measure the context policy instead: a scripted many-step task whose prompts go to an "
            "in-process engine; prompt and cached tokens per step against the context budget.",
        ),
    ] = False,
    model: Annotated[
        str,
        typer.Option(
            "--model", help="With --long-session: the engine's model, or `tiny` (random, built here)."
        ),
    ] = "smollm2-135m-instruct",
    budget_tokens: Annotated[
        int, typer.Option("--budget-tokens", min=1, help="With --long-session: the task's context budget.")
    ] = 3584,
    recall: Annotated[
        bool, typer.Option("--recall/--no-recall", help="With --long-session: retrieval of folded steps.")
    ] = True,
    device: DeviceOption = "cpu",
    per_step: Annotated[
        bool, typer.Option("--per-step", help="With --long-session --json: every step's token counts too.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Checkpoint overhead: milliseconds to persist one step (append + commit), median and p95; or, with
    --long-session, the context policy's prompt tokens and prefix-cache share over a long task."""
    if long_session:
        with user_errors():
            session = asyncio.run(
                _long_session(state(ctx), steps or 200, model, budget_tokens, recall, device)
            )
        _report_long_session(session, as_json, per_step)
        return
    from tether.agents.bench import bench_step_persist
    from tether.store.journal import Journal

    with user_errors(), tempfile.TemporaryDirectory() as scratch:
        url = store or f"sqlite:///{Path(scratch) / 'bench.db'}"
        journal = Journal(url, table_prefix=f"bench{int(time.time())}_")
        try:
            result = bench_step_persist(journal, steps or 500)
        finally:
            journal.drop_schema()
            journal.close()
    warn_if_busy(result.machine)
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


async def _long_session(
    cli: CliState, steps: int, model: str, budget_tokens: int, recall: bool, device: str
) -> LongSessionResult:
    """A scratch journal and a one-slot sandbox for the survey task, its prompts sent to `model`."""
    from tether.agents.long_session import run_long_session, survey_task
    from tether.agents.memory import MiniLMEmbedder, minilm_installed
    from tether.agents.service import AgentsConfig, AgentStack
    from tether.serving.engine_client import EngineClient

    survey_task(steps, budget_tokens)  # bad settings are refused before anything loads
    settings = cli.settings()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        if model == "tiny":  # a byte a token: a longer window than the default tiny model's 2048
            from tether.testing import make_tiny_model

            model = str(make_tiny_model(root / "tiny", "qwen2", max_position_embeddings=8192))
        engine = EngineClient(model, settings.cache_dir, kv_cache_mib=512, device=device)
        stack = AgentStack(AgentsConfig.embedded(root / "agents"))
        pool = open_sandbox(settings, slots=1)
        try:
            await pool.start()
            embedder = MiniLMEmbedder if recall and minilm_installed() else None
            return await run_long_session(stack, pool, engine, steps, budget_tokens, embedder)
        finally:
            await pool.close()
            await stack.close()
            await engine.close()


def _report_long_session(result: LongSessionResult, as_json: bool, per_step: bool) -> None:
    summary = asdict(result)
    steps = summary.pop("per_step")
    if as_json:
        print_json({**summary, **({"per_step": steps} if per_step else {})})
        return
    console.print(
        f"{result.steps} steps ({result.status}) within a budget of {result.budget_tokens} tokens: prompt "
        f"tokens max {result.max_prompt_tokens}, median {result.median_prompt_tokens:.0f}; cached share "
        f"{result.cached_share:.3f} overall, {result.cached_share_last_window:.3f} over the last "
        f"{result.last_window_steps} steps; {result.fold_points} fold points; {result.seconds:.1f} s",
        highlight=False,
    )
