"""`tether rl`: RL tools beside `tether train`; `tether rl bench` times GRPO steps against TRL, `tether rl
bench-sync` the paths that bring new weights to engine processes.

The benchmark prints one JSON object on stdout (with --json) or a table, progress goes to stderr, and
the result is always written to a JSON file as well. Whatever the libraries it drives print (TRL and
transformers log to stdout) is sent to stderr, so that stdout stays one JSON object.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tether.cli.common import CacheDirOption, cache_root, phases, print_json, user_errors
from tether.machine import warn_if_busy

RUNS = ("tether_sync", "tether_async", "trl")
CAPTION_KEYS = (
    "step_speedup_vs_trl",
    "informative_step_speedup_vs_trl",
    "informative_step_async_speedup_vs_trl",
    "informative_cpu_speedup_vs_trl",
)

app = typer.Typer(help="RL tools: the training-step and weight-sync benchmarks (training: tether train).")


def bench_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"rl bench: {result['model']}, {result['task']}")
    for column in ("run", "step s", "generating", "cpu s", "reward per step"):
        table.add_column(column, justify="left" if column in ("run", "reward per step") else "right")
    informative = result.get("informative", {})
    rows = [(name, result[name]) for name in RUNS if name in result]
    rows += [(f"{name} (informative)", informative[name]) for name in RUNS if name in informative]
    for name, run in rows:
        table.add_row(
            name,
            f"{run['step_s']:.1f}",
            f"{run['generate_fraction']:.0%}",
            f"{run['cpu_s']:.1f}",
            " ".join(f"{r:.2f}" for r in run["reward"]),
        )
    table.caption = "\n".join(f"{key} {result[key]:.2f}" for key in CAPTION_KEYS if key in result) + (
        f"\nall groups informative: {informative['all_groups_informative']}" if informative else ""
    )
    return table


@app.command("bench")
def bench_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Option("--model", help="Registered model name or HF folder.")] = (
        "smollm2-135m-instruct"
    ),
    prompts: Annotated[int, typer.Option("--prompts", help="Prompts per step.")] = 8,
    samples: Annotated[int, typer.Option("--samples", help="Completions per prompt (>= 2).")] = 4,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Longest completion.")] = 64,
    steps: Annotated[int, typer.Option("--steps", help="Measured steps (the figure is their median).")] = 3,
    warmup_steps: Annotated[
        int, typer.Option("--warmup-steps", help="Steps run first and left out of the figures.")
    ] = 1,
    lr: Annotated[float, typer.Option("--lr", help="Learning rate of every run.")] = 3e-5,
    seed: Annotated[int, typer.Option("--seed", help="Seed of tasks, sampling and torch.")] = 0,
    trl: Annotated[
        bool, typer.Option("--trl/--no-trl", help="Also run TRL's GRPOTrainer (pip install trl).")
    ] = True,
    threads: Annotated[
        int | None,
        typer.Option("--threads", help="Torch threads of every run (default: the free cores at the start)."),
    ] = None,
    informative: Annotated[
        bool,
        typer.Option(
            "--informative/--no-informative",
            help="Also time a step whose every group has mixed rewards (prompts probed first).",
        ),
    ] = True,
    informative_repeats: Annotated[
        int, typer.Option("--informative-repeats", help="Fresh runs whose informative step is timed.")
    ] = 2,
    cache_dir: CacheDirOption = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="JSON result file (default: runs/rl-bench-<time>.json)."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of a table.")
    ] = False,
) -> None:
    """Median seconds per GRPO step: tether sync, tether async and TRL, same model, task and batch; then
    the informative step (every group with mixed rewards) on its own. Took 20 minutes at 4 prompts x 4
    samples x 32 tokens, 1 + 1 steps, one informative repeat, on 2 cores at load 6-8; the default sizes
    take several times that on such a machine."""
    with user_errors():
        from tether.rl.bench import run_bench  # torch: loaded only when benchmarking
        from tether.rl.bench_config import BenchConfig

        config = BenchConfig(
            model=model,
            cache_dir=cache_root(ctx, cache_dir),
            prompts=prompts,
            samples=samples,
            max_new_tokens=max_new_tokens,
            steps=steps,
            warmup_steps=warmup_steps,
            lr=lr,
            seed=seed,
            trl=trl,
            threads=threads,
            informative=informative,
            informative_repeats=informative_repeats,
        )
        with phases(echo=True) as report, contextlib.redirect_stdout(sys.stderr):
            result = run_bench(config, report)
    show_result(
        result, out or Path("runs") / f"rl-bench-{time.strftime('%Y%m%d-%H%M%S')}.json", as_json, bench_table
    )


def sync_table(result: dict[str, Any]) -> Table:
    size = f"{result['bytes'] / 2**20:.0f} MiB"
    table = Table(title=f"rl bench-sync: {result['model']} ({size}) to {result['engines']} engines")
    for column in ("path", "median s", "each s"):
        table.add_column(column, justify="left" if column == "path" else "right")
    for name, seconds in result["seconds"].items():
        table.add_row(name, f"{result[f'{name}_s']:.2f}", " ".join(f"{s:.2f}" for s in seconds))
    caption = [f"collective_speedup_vs_object_store {result['collective_speedup_vs_object_store']:.2f}"]
    if result["fsdp2_max_abs_diff_vs_single"] is not None:
        caption.append(
            f"FSDP2 (2 ranks) vs single: weights within {result['fsdp2_max_abs_diff_vs_single']:.1e}, "
            f"rank memory {result['rank_memory_ratio_2_vs_1']:.3f}x, step "
            f"{result['step_s_2_ranks']:.2f} s vs {result['step_s_single']:.2f} s (cores shared)"
        )
    table.caption = "\n".join(caption)
    return table


def show_result(
    result: dict[str, Any], path: Path, as_json: bool, table: Callable[[dict[str, Any]], Table]
) -> None:
    """Write a benchmark's result to `path`, then print it: one JSON object, or its table; a busy
    machine's warnings go to stderr."""
    warn_if_busy(result["machine"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        print_json(result)
        return
    console = Console()
    console.print(table(result))
    console.print(f"result written to {path}")


@app.command("bench-sync")
def bench_sync_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Option("--model", help="Registered model name or HF folder.")] = (
        "smollm2-135m-instruct"
    ),
    engines: Annotated[int, typer.Option("--engines", help="Engine processes that take each version.")] = 2,
    repeats: Annotated[int, typer.Option("--repeats", help="Measured versions per path (median).")] = 3,
    warmup: Annotated[int, typer.Option("--warmup", help="Versions per path left out of the figures.")] = 1,
    bucket_mib: Annotated[float, typer.Option("--bucket-mib", help="Most MiB per broadcast.")] = 64.0,
    backend: Annotated[
        str, typer.Option("--backend", help="Collective backend: gloo, or nccl (a GPU per rank).")
    ] = "gloo",
    device: Annotated[str, typer.Option("--device", help="The engines' device: cpu or cuda.")] = "cpu",
    learner_steps: Annotated[
        int,
        typer.Option(
            "--learner-steps", help="Learner steps single and as 2 FSDP2 ranks on the same batches (0: skip)."
        ),
    ] = 3,
    smoke: Annotated[
        bool, typer.Option("--smoke", help="A tiny random model and one version per path (seconds).")
    ] = False,
    cache_dir: CacheDirOption = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="JSON result file (default: runs/rl-bench-sync-<time>.json)."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of a table.")
    ] = False,
) -> None:
    """Median seconds to bring new weights to engine processes: Ray's object store, a safetensors folder
    and the collective broadcast, on the same engines in the same run; then the FSDP2 learner's weight
    gap to the single-process learner and its per-rank memory."""
    with user_errors(), tempfile.TemporaryDirectory(prefix="tether-bench-sync-model-") as folder:
        from tether.rl.sync_bench import SyncBenchConfig, run_sync_bench, smoke_config

        config = (
            smoke_config(Path(folder))
            if smoke
            else SyncBenchConfig(
                model=model,
                cache_dir=cache_root(ctx, cache_dir),
                engines=engines,
                repeats=repeats,
                warmup=warmup,
                bucket_mib=bucket_mib,
                backend=backend,
                device=device,
                learner_steps=learner_steps,
            )
        )
        with phases(echo=True) as report, contextlib.redirect_stdout(sys.stderr):
            result = run_sync_bench(config, report)
    default = Path("runs") / f"rl-bench-sync-{time.strftime('%Y%m%d-%H%M%S')}.json"
    show_result(result, out or default, as_json, sync_table)
