"""`tether jobs ...`: submit, list, show and cancel jobs of the local back end."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from tether.cli.common import err_console, print_json, user_errors
from tether.scheduler.job import JobKind, JobState
from tether.scheduler.policy import POLICIES

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


def _backend(db: Path | None, policy: str | None = None) -> LocalBackend:
    from tether.scheduler.local import LocalBackend
    from tether.scheduler.store import default_store_path

    return LocalBackend.open(db or default_store_path(), policy=policy)


def _when(stamp: float | None) -> str:
    return "" if stamp is None else datetime.datetime.fromtimestamp(stamp).strftime("%H:%M:%S")


def _show(record: JobRecord, as_json: bool) -> None:
    if as_json:
        print_json(record.summary())
        return
    table = Table(title=f"job {record.id}", show_header=False)
    for key, value in record.summary().items():
        table.add_row(key, " ".join(value) if isinstance(value, list) else str(value))
    console.print(table)


@app.command("submit")
def submit_command(
    command: Annotated[list[str], typer.Argument(help="The command, after '--'.")],
    cpus: Annotated[float, typer.Option("--cpus", min=0, help="CPU cores the job needs.")] = 1.0,
    memory_mib: Annotated[int, typer.Option("--memory-mib", min=0, help="Memory the job needs, MiB.")] = 512,
    accelerators: Annotated[int, typer.Option("--accelerators", min=0, help="Accelerators it needs.")] = 0,
    priority: Annotated[int, typer.Option("--priority", help="Higher runs first under 'priority'.")] = 0,
    preemptible: Annotated[
        bool, typer.Option("--preemptible", help="May be stopped for a higher-priority job (and requeued).")
    ] = False,
    expected_duration_s: Annotated[
        float, typer.Option("--expected-duration-s", help="Estimate used by backfill.")
    ] = 3600.0,
    kind: Annotated[JobKind, typer.Option("--kind", help="What the job is.")] = JobKind.AGENT,
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

    with user_errors():
        backend = _backend(db, policy)
        record = backend.submit(
            JobRequest(
                command=tuple(command),
                name=name or Path(command[0]).name,
                cwd=os.getcwd(),
                kind=kind,
                tenant=tenant,
                priority=priority,
                preemptible=preemptible,
                cpus=cpus,
                memory_mib=memory_mib,
                accelerators=accelerators,
                expected_duration_s=expected_duration_s,
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
    state: Annotated[JobState | None, typer.Option("--state", help="Only jobs in this state.")] = None,
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """List jobs, oldest first."""
    with user_errors():
        backend = _backend(db)
        backend.schedule()
        records = backend.store.all((state,) if state else ())
    if not records:  # a store opened in the wrong place looks like this too: say which one it was
        where = f"no jobs{f' {state.value}' if state else ''} in {backend.store.path}"
        err_console.print(where, highlight=False, soft_wrap=True)
    if as_json:
        print_json({"policy": backend.policy.name, "jobs": [r.summary() for r in records]})
        return
    table = Table(title=f"jobs ({backend.policy.name})")
    for column in ("id", "name", "state", "cpus", "MiB", "acc", "prio", "submitted", "started", "exit"):
        table.add_column(
            column, justify="right" if column in ("id", "cpus", "MiB", "acc", "prio") else "left"
        )
    for r in records:
        request = r.request
        table.add_row(
            str(r.id),
            request.name,
            r.state.value,
            f"{request.cpus:g}",
            str(request.memory_mib),
            str(request.accelerators),
            str(request.priority),
            _when(r.submitted_at),
            _when(r.started_at),
            "" if r.exit_code is None else str(r.exit_code),
        )
    console.print(table)


@app.command("show")
def show_command(
    job_id: Annotated[int, typer.Argument(help="Job id from `submit` or `list`.")],
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """Everything the store knows about one job, including its log file."""
    with user_errors():
        backend = _backend(db)
        backend.schedule()
        record = backend.get(job_id)
    _show(record, as_json)


@app.command("cancel")
def cancel_command(
    job_id: Annotated[int, typer.Argument(help="Job id from `submit` or `list`.")],
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """Cancel a queued job, or kill a running one's whole process group."""
    with user_errors():
        record = _backend(db).cancel(job_id)
    _show(record, as_json)
