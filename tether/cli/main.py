"""Entry point of the `tether` command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from tether.cli import engine, envs, models, sandbox
from tether.cli.agent import app as agent_app
from tether.cli.common import CliState, state, user_errors
from tether.cli.demo import demo_command
from tether.cli.eval import eval_command
from tether.cli.gateway import app as gateway_app
from tether.cli.jobs import app as jobs_app
from tether.cli.rl import app as rl_app
from tether.cli.serve import serve_command
from tether.cli.sim import sim_command
from tether.cli.train import train_command
from tether.cli.worker import worker_command
from tether.config import TetherSettings

app = typer.Typer(help="tether: train and run long-horizon LLM agents.", no_args_is_help=True)
app.add_typer(sandbox.app, name="sandbox")
app.add_typer(models.app, name="models")
app.add_typer(engine.app, name="engine")
app.add_typer(envs.app, name="envs")
app.command("serve")(serve_command)
app.command("eval")(eval_command)
app.command("sim")(sim_command)
app.command("train")(train_command)
app.add_typer(rl_app, name="rl")
app.add_typer(jobs_app, name="jobs")
app.add_typer(agent_app, name="agent")
app.add_typer(gateway_app, name="gateway")
app.command("worker")(worker_command)
app.command("demo")(demo_command)
config_app = typer.Typer(help="Inspect the layered configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")
console = Console()


@app.callback()
def main(
    ctx: typer.Context,
    config_file: Annotated[Path | None, typer.Option("--config", help="TOML settings file.")] = None,
) -> None:
    """Settings come from defaults, then --config (or $TETHER_CONFIG, or ./tether.toml), then TETHER_*."""
    ctx.obj = CliState(config_file)


@config_app.command("show")
def config_show(ctx: typer.Context) -> None:
    """Print the effective settings as JSON, after every layer is applied."""
    with user_errors():
        settings: TetherSettings = state(ctx).settings()
    console.print_json(settings.model_dump_json())
