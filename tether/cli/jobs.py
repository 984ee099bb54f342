"""`tether jobs ...`: submit, list, show and cancel jobs of the local back end.

A submitted command that is one of tether's own workloads (`tether train`, `eval`, `serve`, a fleet of
`tether sandbox serve`) is recognized (or named with `--workload`); a train job's run directory is read
from its config here, so that a preempted one resumes from its checkpoint.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from tether.cli.common import err_console, print_json, user_errors
from tether.scheduler.job import JobKind, JobState
from tether.scheduler.policy import POLICIES
from tether.scheduler.workload import WorkloadKind

if TYPE_CHECKING:
    from tether.scheduler.local import LocalBackend
    from tether.scheduler.store import JobRecord

app = typer.Typer(
    help="Jobs on this machine, scheduled by CPU, memory and accelerator demand.", no_args_is_help=True
)
console = Console()

DbOption = Annotated[
    Path | None, typer.Option("--db", help="Job store (SQLite); default $TETHER_HOME/jobs.sqlite.")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


_ACCELERATORS = "tether.jobs.machine_accelerators"


@app.callback()
def jobs_callback(
    ctx: typer.Context,
    machine_accelerators: Annotated[
        int | None,
        typer.Option(
            "--machine-accelerators",
            min=0,
            help="Accelerators this machine offers (default: detected; remembered in the store).",
        ),
    ] = None,
) -> None:
    """Jobs on this machine, scheduled by CPU, memory and accelerator demand."""
    ctx.meta[_ACCELERATORS] = machine_accelerators


def _backend(ctx: typer.Context, db: Path | None, policy: str | None = None) -> LocalBackend:
    from tether.scheduler.local import LocalBackend
    from tether.scheduler.store import default_store_path

    accelerators = ctx.meta.get(_ACCELERATORS)
    return LocalBackend.open(db or default_store_path(), policy=policy, accelerators=accelerators)


def _run_dir(command: tuple[str, ...], cwd: Path) -> str:
    """A train job's run directory: its `--resume RUN_DIR`, or its config's `run.out_dir/run.name`."""
    from tether.rl.config import load_config
    from tether.scheduler.workload import option_value

    resumed = option_value(command, "--resume")
    if resumed is not None:
        return str((cwd / resumed).resolve())
    config = option_value(command, "--config")
    assert config is not None, "check_workload asks for --config or --resume"
    return str((cwd / load_config(cwd / config).run_dir).resolve())


def _when(stamp: float | None) -> str:
    return "" if stamp is None else datetime.datetime.fromtimestamp(stamp).strftime("%H:%M:%S")


def _show(record: JobRecord, as_json: bool) -> None:
    if as_json:
        print_json(record.summary())
        return
    table = Table(title=f"job {record.id}", show_header=False)
    for key, value in record.summary().items():
        table.add_row(key, " ".join(str(v) for v in value) if isinstance(value, list) else str(value))
    console.print(table)


@app.command("submit")
def submit_command(
    ctx: typer.Context,
    command: Annotated[
        list[str] | None, typer.Argument(help="The command, after '--' (a sandbox fleet may omit it).")
    ] = None,
    workload: Annotated[
        WorkloadKind | None,
        typer.Option("--workload", help="What the command is (default: recognized from the command)."),
    ] = None,
    replicas: Annotated[
        int, typer.Option("--replicas", help="Processes of a gang (a sandbox fleet: its instances).")
    ] = 1,
    cpus: Annotated[float, typer.Option("--cpus", min=0, help="CPU cores each replica needs.")] = 1.0,
    memory_mib: Annotated[
        int, typer.Option("--memory-mib", min=0, help="Memory each replica needs, MiB.")
    ] = 512,
    accelerators: Annotated[
        int, typer.Option("--accelerators", min=0, help="Accelerators each replica needs.")
    ] = 0,
    priority: Annotated[int, typer.Option("--priority", help="Higher runs first under 'priority'.")] = 0,
    preemptible: Annotated[
        bool, typer.Option("--preemptible", help="May be stopped for a higher-priority job (and requeued).")
    ] = False,
    stop_grace_s: Annotated[
        float,
        typer.Option(
            "--stop-grace-s",
            help="How long a preempted job may take to stop (a step + checkpoint) before SIGKILL.",
        ),
    ] = 120.0,
    max_restarts: Annotated[
        int, typer.Option("--max-restarts", help="Restarts of a failed service (serve, sandbox fleet).")
    ] = 3,
    expected_duration_s: Annotated[
        float, typer.Option("--expected-duration-s", help="Estimate used by backfill.")
    ] = 3600.0,
    kind: Annotated[
        JobKind | None, typer.Option("--kind", help="What the job is (default: from the workload).")
    ] = None,
    name: Annotated[str, typer.Option("--name", help="A label for `list`.")] = "",
    tenant: Annotated[str, typer.Option("--tenant", help="Who the job is for (fair share).")] = "default",
    policy: Annotated[
        str | None, typer.Option("--policy", help=f"Scheduling policy of this store: {', '.join(POLICIES)}.")
    ] = None,
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """Queue a command; it starts at once if the machine has room for its demand."""
    from tether.scheduler.store import JobRequest
    from tether.scheduler.workload import WORKLOADS, check_workload, recognize

    with user_errors():
        argv = tuple(command or ())
        chosen = WORKLOADS[workload or recognize(argv)]
        if not argv and chosen.subcommand:
            argv = ("tether", *chosen.subcommand)
        cwd = Path.cwd()
        check_workload(chosen, argv, replicas)
        backend = _backend(ctx, db, policy)
        record = backend.submit(
            JobRequest(
                command=argv,
                name=name
                or (f"{chosen.kind.value}" if chosen.subcommand else Path(argv[0]).name if argv else ""),
                cwd=str(cwd),
                kind=kind or chosen.job_kind,
                tenant=tenant,
                priority=priority,
                preemptible=preemptible,
                cpus=cpus,
                memory_mib=memory_mib,
                accelerators=accelerators,
                expected_duration_s=expected_duration_s,
                workload=chosen.kind,
                replicas=replicas,
                run_dir=_run_dir(argv, cwd) if chosen.resumable else "",
                stop_grace_s=stop_grace_s,
                max_restarts=max_restarts,
            )
        )
    if as_json:
        print_json(record.summary())
    else:
        console.print(
            f"job {record.id} {record.state.value}" + (f" (pid {record.pid})" if record.pid else "")
        )


@app.command("list")
def list_command(
    ctx: typer.Context,
    state: Annotated[JobState | None, typer.Option("--state", help="Only jobs in this state.")] = None,
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """List jobs, oldest first."""
    with user_errors():
        backend = _backend(ctx, db)
        backend.schedule()
        records = backend.store.all((state,) if state else ())
    if not records:  # a store opened in the wrong place looks like this too: say which one it was
        where = f"no jobs{f' {state.value}' if state else ''} in {backend.store.path}"
        err_console.print(where, highlight=False, soft_wrap=True)
    if as_json:
        machine = {"accelerators": backend.capacity.accelerators, "islands": backend.capacity.islands}
        print_json(
            {"policy": backend.policy.name, "machine": machine, "jobs": [r.summary() for r in records]}
        )
        return
    islands = len(backend.capacity.islands)
    table = Table(
        title=f"jobs ({backend.policy.name}; {backend.capacity.accelerators} accelerators"
        + (f" in {islands} NVLink islands)" if islands > 1 else ")")
    )
    numeric = ("id", "acc", "prio", "preempted", "resumed")
    columns = ("id", "name", "workload", "state", "acc", "devices", "prio", "preempted", "resumed", "exit")
    for column in columns:
        table.add_column(column, justify="right" if column in numeric else "left")
    for r in records:
        request = r.request
        table.add_row(
            str(r.id),
            request.name,
            request.workload.value + (f" x{request.replicas}" if request.replicas > 1 else ""),
            r.state.value,
            str(request.accelerators),
            ",".join(str(d) for d in r.devices),
            str(request.priority),
            str(r.preemptions),
            str(r.resumes),
            "" if r.exit_code is None else str(r.exit_code),
        )
    console.print(table)


@app.command("show")
def show_command(
    ctx: typer.Context,
    job_id: Annotated[int, typer.Argument(help="Job id from `submit` or `list`.")],
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """Everything the store knows about one job, including its log file."""
    with user_errors():
        backend = _backend(ctx, db)
        backend.schedule()
        record = backend.get(job_id)
    _show(record, as_json)


@app.command("cancel")
def cancel_command(
    ctx: typer.Context,
    job_id: Annotated[int, typer.Argument(help="Job id from `submit` or `list`.")],
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """Cancel a queued job, or kill a running one's whole process group."""
    with user_errors():
        record = _backend(ctx, db).cancel(job_id)
    _show(record, as_json)
