"""Entry point of the `tether` command.

Only typer is imported here: each subcommand's module is imported when that subcommand runs (see
`tether.cli.lazy`), so `tether --help` and shell completion stay fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tether.cli.lazy import LazyCommand, LazyGroup

COMMANDS = {
    "serve": LazyCommand(
        "tether.cli.serve:serve_command",
        "Serve a model: POST /v1/chat/completions and /v1/completions, GET /v1/models, /healthz, /metrics.",
    ),
    "eval": LazyCommand(
        "tether.cli.eval:eval_command",
        "Run episodes through a model: per-domain mean reward, pass rate, tokens and sandbox time.",
    ),
    "sim": LazyCommand(
        "tether.cli.sim:sim_command",
        "Simulate a job trace under each policy: JCT, queueing, utilization, fragmentation, slowdowns.",
    ),
    "train": LazyCommand(
        "tether.cli.train:train_command",
        "Train a policy with RL on an environment mixture (GRPO family), checkpointing as it goes.",
    ),
    "worker": LazyCommand(
        "tether.cli.worker:worker_command",
        "Run agent tasks from the queue until stopped (Ctrl-C: after the current steps; SIGKILL is safe).",
    ),
    "demo": LazyCommand(
        "tether.cli.demo:demo_command",
        "RL on a domain mixture with SmolLM2, evaluated on held-out seeds before and after training.",
    ),
    "sandbox": LazyCommand("tether.cli.sandbox:app", "Isolated execution of untrusted code."),
    "models": LazyCommand(
        "tether.cli.models:app",
        "Models: pull registered models into the cache, list them, check this CPU's kernels.",
    ),
    "engine": LazyCommand("tether.cli.engine:app", "The inference engine: benchmarks."),
    "envs": LazyCommand("tether.cli.envs:app", "Verifiable environments: list, inspect, score."),
    "rl": LazyCommand(
        "tether.cli.rl:app",
        "RL tools: the training-step and weight-sync benchmarks (training: tether train).",
    ),
    "jobs": LazyCommand(
        "tether.cli.jobs:app", "Jobs on this machine, scheduled by CPU, memory and accelerator demand."
    ),
    "agent": LazyCommand("tether.cli.agent:app", "Durable long-horizon agents: tasks, steps, resume."),
    "gateway": LazyCommand("tether.cli.gateway:app", "The API gateway: keys, usage, serving and benchmarks."),
    "console": LazyCommand(
        "tether.cli.console:console_command",
        "Serve the web console: runs, agents, sandboxes, usage and keys, jobs, and a chat playground.",
    ),
    "up": LazyCommand(
        "tether.cli.up:app",
        "Start a local cluster from a cluster.toml (sandbox servers, engines, gateway, agent workers).",
    ),
    "down": LazyCommand(
        "tether.cli.up:down_command",
        "Stop a local cluster started by `tether up`: every piece, last started first; removes its state.",
    ),
}


class TetherGroup(LazyGroup):
    lazy = COMMANDS


app = typer.Typer(
    cls=TetherGroup,
    help="tether: train and run long-horizon LLM agents.",
    no_args_is_help=True,
    # Plain help: rich markup would eat `[ray]`-style text, cut long option names at 80 columns, and
    # its renderer alone costs more than the start-up budget of `tether --help`.
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
config_app = typer.Typer(help="Inspect the layered configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"tether {version('tether')}")
        raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    config_file: Annotated[Path | None, typer.Option("--config", help="TOML settings file.")] = None,
    show_version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Settings come from defaults, then --config (or $TETHER_CONFIG, or ./tether.toml), then TETHER_*."""
    from tether.cli.common import CliState

    ctx.obj = CliState(config_file)


@config_app.command("show")
def config_show(ctx: typer.Context) -> None:
    """Print the effective settings as JSON, after every layer is applied (`home` is the state directory)."""
    from rich.console import Console

    from tether.cli.common import state, user_errors

    with user_errors():
        settings = state(ctx).settings()
    Console().print_json(settings.model_dump_json())
