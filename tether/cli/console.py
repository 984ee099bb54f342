"""`tether console`: the web console over the stores the other commands use, served by uvicorn."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tether.cli.common import err_console, state, user_errors
from tether.cli.gateway import ConfigOption, LedgerOption
from tether.cli.gateway import _config as gateway_config
from tether.cli.worker import (
    ArtifactsOption,
    BusNameOption,
    BusOption,
    HomeOption,
    Locations,
    StoreOption,
    TablePrefixOption,
)

RunsOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--runs", help="A directory of runs (tether train/demo --out); repeat for more (default: runs)."
    ),
]
SandboxOption = Annotated[
    list[str] | None,
    typer.Option(
        "--sandbox-url", help="A `tether sandbox serve` whose /metrics the sandboxes page reads; repeat."
    ),
]
ModelUrlOption = Annotated[
    list[str] | None,
    typer.Option("--model-url", help="An OpenAI-compatible /v1 URL for the chat playground; repeat."),
]


def console_command(
    ctx: typer.Context,
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on; beyond loopback, sign-in needs an admin key.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="TCP port to listen on.")] = 8700,
    runs: RunsOption = None,
    home: HomeOption = None,
    store: StoreOption = None,
    bus: BusOption = None,
    bus_name: BusNameOption = "tether-tasks",
    artifacts: ArtifactsOption = None,
    table_prefix: TablePrefixOption = "agent_",
    config_file: ConfigOption = None,
    ledger_url: LedgerOption = None,
    jobs_db: Annotated[
        Path | None, typer.Option("--jobs-db", help="Job store (default $TETHER_HOME/jobs.sqlite).")
    ] = None,
    sandbox_urls: SandboxOption = None,
    model_urls: ModelUrlOption = None,
    model_api_key: Annotated[
        str | None,
        typer.Option("--model-api-key", envvar="TETHER_CONSOLE_MODEL_KEY", help="Key the playground sends."),
    ] = None,
) -> None:
    """Serve the web console: runs, agents, sandboxes, usage and keys, jobs, and a chat playground."""
    with user_errors():
        import uvicorn

        from tether.console.app import create_app
        from tether.console.config import ConsoleConfig
        from tether.scheduler.store import default_store_path

        agents = Locations(home, store, bus, bus_name, artifacts, table_prefix).config(state(ctx))
        gateway = gateway_config(config_file, ledger_url)
        config = ConsoleConfig(
            runs=tuple(runs or [Path("runs")]),
            agents=agents,
            gateway=gateway,
            jobs_db=jobs_db or default_store_path(),
            sandbox_urls=tuple(sandbox_urls or ()),
            model_urls=tuple(model_urls or ()),
            model_api_key=model_api_key,
            host=host,
        )
        from tether.console.usage import admin_check

        app = create_app(config, admin_check(gateway) if config.require_admin else None)
        if config.require_admin:
            err_console.print(
                f"console on {host}:{port} is reachable beyond this machine: every request needs a gateway "
                "admin key (tether gateway keys create --admin), entered at /login"
            )
        err_console.print(f"tether console: http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}/")
    uvicorn.run(app, host=host, port=port, log_level="warning")
