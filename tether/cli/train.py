"""`tether train`: run an RL job from a TOML config (or resume one) with a live view of every step.

The run directory (`run.out_dir/run.name`) receives `config.toml`, `metrics.jsonl`, `transcripts.jsonl`
and `checkpoints/`. SIGTERM or Ctrl-C finishes the current step and checkpoints it (`Trainer.run`);
`--resume RUN_DIR` continues from the latest checkpoint with the run's own `config.toml`.
A sharded learner (`[learner] strategy = "fsdp"`) runs as `torchrun --nproc-per-node N -m tether train
--config ...` (rank 0 trains, the other ranks follow it), or as plain `tether train`, which then starts
ranks 1..N-1 itself on this machine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tether.cli.common import fail, sandbox_provider, state, user_errors

if TYPE_CHECKING:
    from tether.cli.plan import PlanOptions
    from tether.rl.config import TrainConfig
    from tether.rl.trainer import Metrics

console = Console()


def _headline(config: TrainConfig, metrics: Metrics) -> str:
    return (
        f"step {int(metrics['step'])}/{config.run.steps}  reward {metrics['reward']:.3f}  "
        f"pass {metrics['pass_rate']:.1%}  {metrics['tokens_per_s']:.0f} tok/s  "
        f"staleness {metrics['staleness_mean']:.2f} (max {metrics['staleness_max']:.0f})  "
        f"loss {metrics.get('learner/loss', 0.0):+.4f}  "
        f"logprob diff {metrics.get('learner/max_logprob_diff', 0.0):.1e} "
        f"over {metrics.get('learner/compared_tokens', 0.0):.0f} tokens  "
        f"ratio {metrics.get('learner/ratio_min', 1.0):.3f}..{metrics.get('learner/ratio_max', 1.0):.3f} "
        f"(std {metrics.get('learner/ratio_std', 0.0):.1e}){_failures(metrics)}"
    )


def _failures(metrics: Metrics) -> str:
    """Rollouts the infrastructure failed (left out of learning) and retried, when a step had any."""
    failed, retried = metrics.get("rollout/infra_failed", 0.0), metrics.get("rollout/retried", 0.0)
    if not failed and not retried:
        return ""
    reasons = sorted(
        key.rsplit("/", 1)[1] for key in metrics if key.startswith("rollout/infra_failed/") and metrics[key]
    )
    why = f" ({', '.join(reasons)})" if reasons else ""
    return f"  infra-failed {failed:.0f}{why}, retried {retried:.0f}"


def _domains(metrics: Metrics) -> list[str]:
    return sorted(
        {key.split("/")[1] + "/" + key.split("/")[2] for key in metrics if key.startswith("domain/")}
    )


def _cost(metrics: Metrics) -> str | None:
    """The step's rollout tokens, what they would cost at the gateway, and the sandbox's CPU time."""
    if "cost/standard_usd" not in metrics:
        return None
    cached, uncached = metrics["tokens/prompt_cached"], metrics["tokens/prompt_uncached"]
    return (
        f"cost ${metrics['cost/standard_usd']:.6f} standard, ${metrics['cost/fast_usd']:.6f} fast: "
        f"{cached + uncached:.0f} prompt tokens ({cached:.0f} cached) + {metrics['tokens/output']:.0f} "
        f"output; sandbox CPU {metrics.get('sandbox/cpu_s', 0.0):.2f}s"
    )


def _warnings(config: TrainConfig, metrics: Metrics) -> list[str]:
    """The step's reward-hacking monitors over their `[monitors]` threshold."""
    from tether.rl.monitors import over_thresholds

    return [f"warning: {warning.message}" for warning in over_thresholds(metrics, config.monitors)]


def _threads(metrics: Metrics) -> str:
    """The torch threads the step ran with (they follow the free cores: `run.adapt_threads`)."""
    if "run/threads" not in metrics:
        return ""
    threads = int(metrics["run/threads"])
    return f" on {threads} thread{'s' if threads != 1 else ''}"


def step_line(config: TrainConfig, metrics: Metrics) -> str:
    """One plain line for a step, where the output is not a terminal (a log, `make demo`)."""
    rewards = ", ".join(f"{domain} {metrics[f'domain/{domain}/reward']:.3f}" for domain in _domains(metrics))
    seconds = f"{metrics['time/step_s']:.1f} s{_threads(metrics)}"
    line = f"{config.run.name} {_headline(config, metrics)}  {seconds}  ({rewards})"
    return "; ".join([line, *_warnings(config, metrics)])


def step_view(config: TrainConfig, metrics: Metrics) -> Group:
    """The live view of the latest step: progress, timings, throughput, staleness, cost, the
    reward-hacking monitors' warnings and rewards per domain."""
    head = Text.assemble((f"{config.run.name} ", "bold"), _headline(config, metrics))
    generate, score = metrics["time/generate_s"], metrics["time/score_s"]
    learn, push = metrics["time/learn_s"], metrics.get("time/push_s", 0.0)
    if "time/wait_s" in metrics:  # async: generation and scoring overlap learning on the rollout thread
        split = (
            f"step {metrics['time/step_s']:.1f}s = wait {metrics['time/wait_s']:.1f}s + learn {learn:.1f}s + "
            f"push {push:.2f}s; rollout thread: generate {generate:.1f}s + score {score:.1f}s"
        )
    else:
        split = (
            f"step {metrics['time/step_s']:.1f}s = generate {generate:.1f}s + score {score:.1f}s + "
            f"learn {learn:.1f}s + push {push:.2f}s"
        )
    timing = Text(split + _threads(metrics), style="dim")
    cost = _cost(metrics)
    notes = [Text(cost, style="dim")] if cost is not None else []
    notes += [Text(warning, style="bold yellow") for warning in _warnings(config, metrics)]
    table = Table(box=None, pad_edge=False)
    for column in ("domain", "rollouts", "reward", "pass", "tokens", "truncated", "sandbox s"):
        table.add_column(column, justify="left" if column == "domain" else "right")
    for domain in _domains(metrics):
        prefix = f"domain/{domain}/"
        table.add_row(
            domain,
            f"{metrics[prefix + 'rollouts']:.0f}",
            f"{metrics[prefix + 'reward']:.3f}",
            f"{metrics[prefix + 'pass_rate']:.1%}",
            f"{metrics[prefix + 'response_tokens']:.1f}",
            f"{metrics[prefix + 'truncation_rate']:.1%}",
            f"{metrics[prefix + 'sandbox_s']:.2f}",
        )
    return Group(head, timing, *notes, table)


@contextmanager
def step_progress(
    config: TrainConfig, waiting: str, out: Console = console
) -> Iterator[tuple[Callable[[Metrics], None], Callable[[str], None]]]:
    """Reports of a run as it goes, yielded as (on_step, on_phase): on a terminal a live view of the
    latest step (`waiting` until the first), otherwise `waiting`, then one plain line per step and per
    phase, printed as each one happens (a live view would only print its last frame, at the end)."""
    if out.is_terminal:
        with Live(Text(waiting), console=out, refresh_per_second=2) as live:
            yield (
                lambda metrics: live.update(step_view(config, metrics)),
                lambda phase: live.console.print(f"[bold]{phase}[/]"),
            )
        return
    out.print(waiting, highlight=False, soft_wrap=True)
    yield (
        lambda metrics: out.print(step_line(config, metrics), highlight=False, soft_wrap=True),
        lambda phase: out.print(phase, highlight=False, soft_wrap=True),
    )


def train_command(
    ctx: typer.Context,
    config_file: Annotated[
        Path | None, typer.Option("--config", help="Training config (TOML); see configs/ for examples.")
    ] = None,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="Run directory to continue from its latest checkpoint.")
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option(
            "--backend",
            help="Where the learner runs, and the rollout engines unless rollout.backend says otherwise: "
            "local, or ray (actors, see [ray]); default: run.backend.",
        ),
    ] = None,
    plan: Annotated[
        bool,
        typer.Option(
            "--plan", help="Print the per-rank memory of this run (meta device, nothing allocated); no run."
        ),
    ] = False,
    plan_model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="--plan: architecture (e.g. llama-3-8b, qwen2.5-72b) or HF folder; default: model.name.",
        ),
    ] = None,
    strategy: Annotated[
        str | None, typer.Option("--strategy", help="--plan: single or fsdp; default: learner.strategy.")
    ] = None,
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="--plan: float32, bfloat16, float16; default: model.dtype.")
    ] = None,
    prompt_tokens: Annotated[
        int, typer.Option("--prompt-tokens", help="--plan: prompt length the micro-batch is sized for.")
    ] = 256,
    activation_checkpointing: Annotated[
        bool, typer.Option("--activation-checkpointing", help="--plan: recompute each layer in backward.")
    ] = False,
    kv_cache_tokens: Annotated[
        int | None,
        typer.Option("--kv-cache-tokens", help="--plan: engine KV cache size; default: one step's rollouts."),
    ] = None,
    engine: Annotated[
        bool,
        typer.Option("--engine/--no-engine", help="--plan: the rollout engine shares each rank's device."),
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="--plan: one JSON object.")] = False,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            help="Learner ranks (learner.world_size); a resumed run may change it (checkpoints reshard); "
            "with --plan, the ranks to plan for.",
        ),
    ] = None,
) -> None:
    """Train a policy with RL on an environment mixture (GRPO family), checkpointing as it goes."""
    if plan:
        from tether.cli.plan import PlanOptions

        options = PlanOptions(
            plan_model,
            strategy,
            world_size,
            dtype,
            prompt_tokens,
            activation_checkpointing,
            kv_cache_tokens,
            engine,
        )
        _print_plan(config_file, resume, options, as_json)
        return
    if (config_file is None) == (resume is None):
        fail("give exactly one of --config FILE.toml (a new run) or --resume RUN_DIR")
    # Imported here: torch and the environments load only when a run starts, not for `tether --help`.
    from tether.models import configure_threads
    from tether.rl.builders import build_trainer
    from tether.rl.config import load_config, parse_config
    from tether.rl.ranks import follow_rank, follower_rendezvous

    with user_errors():
        settings = state(ctx).settings()
        if resume is not None:
            config = load_config(resume / "config.toml")
            run = config.run.model_copy(update={"out_dir": resume.parent, "name": resume.name})
            config = config.model_copy(update={"run": run})
        else:
            assert config_file is not None
            config = load_config(config_file)
        if backend is not None:
            raw = config.model_dump()
            config = parse_config({**raw, "run": {**raw["run"], "backend": backend}}, "--backend")
        if world_size is not None:
            raw = config.model_dump()
            learner = {**raw["learner"], "world_size": world_size}
            config = parse_config({**raw, "learner": learner}, "--world-size")
        if config.model.cache_dir is None:
            model = config.model.model_copy(update={"cache_dir": settings.cache_dir})
            config = config.model_copy(update={"model": model})
        rendezvous = follower_rendezvous(config)
        if rendezvous is not None:  # torchrun's rank > 0 of a sharded learner: rank 0 runs the trainer
            follow_rank(config, rendezvous)
            return
        configure_threads()
        sandbox = sandbox_provider(settings)
        trainer = build_trainer(config, sandbox=sandbox, resume=resume is not None)
    try:
        with step_progress(config, f"{config.run.name}: first step...") as (on_step, _):
            trainer.run(on_step=on_step)
    finally:
        trainer.close()
    stopped = " (stopped early: resume with --resume)" if trainer.step < config.run.steps else ""
    console.print(f"run written to {trainer.run_dir} (step {trainer.step}/{config.run.steps}){stopped}")


def _print_plan(config_file: Path | None, resume: Path | None, options: PlanOptions, as_json: bool) -> None:
    """`--plan`: the config's memory per rank (no config: every section's defaults), then exit."""
    if config_file is not None and resume is not None:
        fail("give at most one of --config FILE.toml or --resume RUN_DIR with --plan")
    # Imported here: torch loads only when a plan is asked for, not for `tether --help`.
    from tether.cli.plan import build_plan, print_plan
    from tether.rl.config import load_config

    with user_errors():
        source = config_file if config_file is not None else resume / "config.toml" if resume else None
        config = load_config(source) if source is not None else None
        print_plan(build_plan(config, options), as_json, console)
