"""`tether up --config cluster.toml [--detach]`, `tether up status` and `tether down`: a local cluster of
sandbox servers, engine replicas, the gateway and agent workers (`tether.local_cluster`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from tether.cli.common import err_console, fail, print_json, state, user_errors

if TYPE_CHECKING:
    from tether.local_cluster.control import PieceRow
    from tether.local_cluster.state import ClusterState

app = typer.Typer(invoke_without_command=True)
console = Console()

NameOption = Annotated[str | None, typer.Option("--name", help="The cluster (default: the one that is up).")]


def _home(ctx: typer.Context) -> Path:
    cli = state(ctx)
    if cli.config_file is not None:  # the pieces read the same settings as this command
        os.environ["TETHER_CONFIG"] = str(cli.config_file.absolute())
    with user_errors():
        return cli.settings().home


def _uptime(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def show(cluster: ClusterState, rows: list[PieceRow]) -> None:
    """One table on a terminal, otherwise one plain line per piece."""
    title = f"cluster {cluster.name}: {cluster.phase.value} (state in {cluster.state_dir})"
    cells = [
        (
            r.name,
            str(r.pid or "-"),
            r.url,
            r.status.value,
            "healthy" if r.healthy else "unhealthy",
            str(r.restarts),
            _uptime(r.uptime_s),
        )
        for r in rows
    ]
    if not console.is_terminal:
        typer.echo(title)
        for cell in cells:
            typer.echo("  ".join(cell))
        return
    table = Table(title=title)
    for column in ("piece", "pid", "url", "status", "health", "restarts", "uptime"):
        table.add_column(column, justify="right" if column in ("pid", "restarts", "uptime") else "left")
    for cell, row in zip(cells, rows, strict=True):
        colour = "green" if row.healthy else "red"
        table.add_row(*cell[:4], f"[{colour}]{cell[4]}[/]", *cell[5:])
    console.print(table)


@app.callback()
def up(
    ctx: typer.Context,
    config: Annotated[
        Path | None, typer.Option("--config", help="The cluster file (example: configs/cluster/local.toml).")
    ] = None,
    detach: Annotated[
        bool, typer.Option("--detach", help="Leave the supervisor running in the background and return.")
    ] = False,
) -> None:
    """Start a local cluster from a cluster.toml (sandbox servers, engines, gateway, agent workers).

    In the foreground it supervises until Ctrl-C, which stops everything; with --detach a background
    supervisor does, until `tether down`."""
    if ctx.invoked_subcommand is not None:
        if config is not None or detach:
            fail(f"--config and --detach belong to `tether up`, not to `tether up {ctx.invoked_subcommand}`")
        return
    if config is None:
        fail(
            "give the cluster file: tether up --config cluster.toml (an example: configs/cluster/local.toml)"
        )
    from tether.local_cluster.control import launch_detached, live_rows, stop_cluster, wait_until_up
    from tether.local_cluster.services import check_services
    from tether.local_cluster.state import read_state
    from tether.local_cluster.supervisor import StartFailed, Supervisor, prepare

    home = _home(ctx)
    with user_errors():
        plan = prepare(config, home)
        running = read_state(home, plan.name)
        if running is not None:
            if running.supervisor.alive():
                fail(
                    f"cluster {plan.name!r} is already up (supervisor pid {running.supervisor.pid}): "
                    f"`tether down --name {plan.name}` first"
                )
            stop_cluster(home, plan.name)  # a supervisor that died: clear what it left
            err_console.print(f"cleared the state of a previous {plan.name!r} whose supervisor had died")
        check_services(plan.services)
    err_console.print(
        f"starting {len(plan.pieces)} pieces of {plan.name!r}; logs in {plan.state_dir / 'logs'}"
    )
    if detach:
        process = launch_detached(plan, config, home)
        try:
            cluster = wait_until_up(plan, home, process)
        except RuntimeError as error:
            stop_cluster(home, plan.name)
            fail(str(error), code=1)
        except KeyboardInterrupt:  # a cluster half up, with nobody waiting for it: take it down
            stop_cluster(home, plan.name)
            fail("interrupted while starting; stopped what had started", code=130)
        show(cluster, live_rows(cluster))
        err_console.print(f"supervisor pid {process.pid} runs in the background; stop with `tether down`")
        return

    def on_up(cluster: ClusterState) -> None:
        show(cluster, live_rows(cluster))
        err_console.print("supervising; Ctrl-C stops the cluster", highlight=False)

    from tether.local_cluster.state import remove_state

    try:
        Supervisor(plan, home, config).run(on_up)
    except StartFailed as error:
        remove_state(home, plan.name)
        fail(str(error), code=1)
    err_console.print(f"cluster {plan.name!r} stopped")


@app.command("status")
def status_command(
    ctx: typer.Context,
    name: NameOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Each piece with its pid, URL, health (checked now), restarts and uptime; exit 1 if any is unhealthy."""
    from tether.local_cluster.control import live_rows
    from tether.local_cluster.state import pick_cluster, read_state

    home = _home(ctx)
    with user_errors():
        cluster = read_state(home, pick_cluster(home, name))
    if cluster is None:  # stopped between the two reads
        fail("nothing is up", code=1)
    rows = live_rows(cluster)
    supervised = cluster.supervisor.alive()
    if as_json:
        print_json(
            {
                "name": cluster.name,
                "phase": cluster.phase.value,
                "supervisor_pid": cluster.supervisor.pid if supervised else None,
                "state_dir": cluster.state_dir,
                "pieces": [row.as_dict() for row in rows],
            }
        )
    else:
        show(cluster, rows)
    if not supervised:
        err_console.print(
            f"the supervisor (pid {cluster.supervisor.pid}) is not running: nothing restarts the pieces; "
            "`tether down` clears what is left"
        )
    if not supervised or not all(row.healthy for row in rows):
        raise typer.Exit(1)


def down_command(ctx: typer.Context, name: NameOption = None) -> None:
    """Stop a local cluster started by `tether up`: every piece, last started first; removes its state."""
    from tether.local_cluster.control import stop_cluster
    from tether.local_cluster.state import pick_cluster

    home = _home(ctx)
    with user_errors():
        chosen = pick_cluster(home, name)
    with err_console.status(f"stopping {chosen}"):
        stopped = stop_cluster(home, chosen)
    err_console.print(f"cluster {chosen!r} is down ({len(stopped.pieces)} pieces stopped)", highlight=False)
