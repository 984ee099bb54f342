"""Entry point of the `tether` command."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from tether.cli import engine, envs, models, sandbox
from tether.cli.agent import app as agent_app
from tether.cli.common import CliState, pool_config, state, user_errors
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


@app.command("demo")
def demo(
    ctx: typer.Context,
    out_dir: Annotated[
        Path, typer.Option("--out-dir", help="Where the run's JSON result is written.")
    ] = Path("runs"),
) -> None:
    """The main job on embedded defaults: the sandbox's HumanEval check and throughput benchmark."""
    with user_errors():
        settings = state(ctx).settings()
        slots = 2 * settings.sandbox.slots
        spec = settings.sandbox.spec
        canonical = asyncio.run(sandbox._humaneval(spec, slots, False, True, False, ctx))
        mutated = asyncio.run(sandbox._humaneval(spec, slots, True, True, False, ctx))
        console.print(sandbox.humaneval_table([canonical, mutated]))
        bench = asyncio.run(sandbox._bench(spec, slots, 600, 120, True, False, ctx))
        console.print(sandbox.bench_table(bench))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"demo-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(
        json.dumps(
            {
                "humaneval": canonical.summary(),
                "humaneval_mutated": mutated.summary(),
                "bench": bench,
                "pool": pool_config(settings).slots,
            },
            indent=2,
        )
        + "\n"
    )
    console.print(f"results written to {path}")
    if canonical.passed != canonical.total:
        raise typer.Exit(1)
