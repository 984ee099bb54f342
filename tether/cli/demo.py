"""`tether demo` (what `make demo` runs): the main job on embedded defaults, start to finish.

First HumanEval's canonical solutions through the sandbox (a short check that the sandbox the code
rewards need works), then `tether.rl.demo`: held-out evaluation, a short RL run on the configured
mixture, the same evaluation with the trained weights. Prints the before/after table and writes
`demo.json` beside the trainer's run directory files (metrics, transcripts, report.html).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from tether.cli import sandbox
from tether.cli.common import sandbox_provider, state, user_errors
from tether.cli.train import step_progress

console = Console()
DEFAULT_CONFIG = Path("configs/demo.toml")
LOG_WIDTH = 120  # columns of the table when the output is not a terminal


def demo_command(
    ctx: typer.Context,
    config_file: Annotated[
        Path, typer.Option("--config", help="A train config, plus an optional [demo] (evaluation) section.")
    ] = DEFAULT_CONFIG,
    out_dir: Annotated[
        Path | None,
        typer.Option("--out-dir", help="Where the run directory goes (default: the config's run.out_dir)."),
    ] = None,
) -> None:
    """RL on a domain mixture with SmolLM2, evaluated on held-out seeds before and after training."""
    # Imported here: torch and the environments load only when the demo starts, not for `tether --help`.
    from tether.models import configure_threads
    from tether.rl.demo import Z_CLEAR, comparison_table, load_demo_config, run_demo

    started = time.monotonic()
    with user_errors():
        settings = state(ctx).settings()
        config = load_demo_config(config_file)
        config = config.with_run(
            name=f"{config.train.run.name}-{time.strftime('%Y%m%d-%H%M%S')}",
            out_dir=out_dir or config.train.run.out_dir,
        )
        if config.train.model.cache_dir is None:
            config = config.with_model(cache_dir=settings.cache_dir)
    summary: dict[str, object] | None = None
    if config.demo.humaneval:
        with user_errors():
            slots = 2 * settings.sandbox.slots
            report = asyncio.run(sandbox._humaneval(settings.sandbox.spec, slots, False, True, False, ctx))
        console.print(sandbox.humaneval_table([report]))
        summary = report.summary()
        if report.passed != report.total:
            console.print("[bold red]the sandbox failed HumanEval's canonical solutions: no training[/]")
            raise typer.Exit(1)
    with user_errors():
        configure_threads()
        provider = sandbox_provider(settings)
        with step_progress(config.train, "loading the policy...", console) as (on_step, on_phase):
            result = run_demo(config, sandbox=provider, on_step=on_step, on_phase=on_phase)
    # Piped into a file or a log, rich would squeeze the table into 80 columns.
    wide = console if console.is_terminal else Console(width=LOG_WIDTH)
    wide.line()  # the live view's last frame ends without one
    wide.print(comparison_table(result))
    wall_s = time.monotonic() - started
    path = result.run_dir / "demo.json"
    demo = {
        **config.demo.model_dump(),
        "temperature": config.eval_temperature,
        "max_new_tokens": config.eval_max_new_tokens,
    }
    payload = {"humaneval": summary, "demo": demo, **result.to_dict(), "wall_s": wall_s}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    overall = result.overall
    verdict = "a clear gain" if overall.clear else "no gain beyond the noise"
    console.print(
        f"held-out reward {overall.before:.3f} -> {overall.after:.3f} ({overall.delta:+.3f}, noise "
        f"{Z_CLEAR * overall.stderr:.3f}): {verdict}; {wall_s / 60:.1f} min in all"
    )
    console.print(f"results written to {path}; run (report.html, metrics, transcripts) in {result.run_dir}")
