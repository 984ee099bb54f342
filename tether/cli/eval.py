"""`tether eval`: run environment episodes through a model and report per-domain scores.

The model runs in-process on tether's engine (`--model NAME`), behind any OpenAI-compatible server
(`--base-url URL`, with `--model` naming the served model), or replays a file (`--model scripted:FILE`);
all three are a `ChatClient`. Every episode is written to a JSONL file with each reward component and
the full transcript; a summary JSON sits beside it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tether.chat import ChatClient
from tether.cli.common import (
    DeviceOption,
    DTypeOption,
    MaxModelLenOption,
    RopeScalingOption,
    counted_lines,
    err_console,
    print_json,
    sandbox_provider,
    state,
    user_errors,
)
from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.registry import EnvRegistry, default_registry, parse_env_spec
from tether.eval.runner import EpisodeRecord, EvalSettings, plan_episodes, run_eval
from tether.eval.summary import DomainSummary, summarise

console = Console()


def open_eval_client(
    model: str,
    base_url: str | None,
    api_key: str | None,
    cache_dir: Path,
    device: str,
    dtype: str,
    kv_cache_mib: int,
    max_model_len: int | None = None,
    rope_scaling: str | None = None,
) -> ChatClient:
    """The client `--model`/`--base-url` name (`open_client`)."""
    from tether.serving.engine_client import open_client

    return open_client(
        model,
        base_url,
        cache_dir,
        device=device,
        dtype=dtype,
        api_key=api_key,
        kv_cache_mib=kv_cache_mib,
        max_model_len=max_model_len,
        rope_scaling=rope_scaling,
    )


def summary_table(rows: list[DomainSummary], title: str) -> Table:
    table = Table(title=title)
    for column in (
        "environment",
        "episodes",
        "mean reward",
        "pass rate",
        "mean tokens",
        "sandbox s",
        "errors",
    ):
        table.add_column(column, justify="left" if column == "environment" else "right")
    for row in rows:
        table.add_row(
            row.env,
            str(row.episodes),
            f"{row.mean_reward:.3f}",
            f"{row.pass_rate:.1%}",
            f"{row.mean_completion_tokens:.1f}",
            f"{row.sandbox_time_s:.2f}",
            str(row.errors),
        )
    return table


def eval_command(
    ctx: typer.Context,
    model: Annotated[
        str,
        typer.Option(
            "--model", help="Registered model name or HF folder; with --base-url, the served model."
        ),
    ],
    envs: Annotated[
        str,
        typer.Option(
            "--envs",
            help="NAME[,NAME...] (globs allowed; -n episodes each) or @mixture.toml (-n in all, by weight).",
        ),
    ],
    count: Annotated[
        int, typer.Option("-n", min=1, help="Episodes per environment (or in all, for a mixture).")
    ] = 20,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of each environment's first task.")] = 0,
    base_url: Annotated[
        str | None,
        typer.Option("--base-url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1."),
    ] = None,
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="OPENAI_API_KEY", help="Bearer token for --base-url.")
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Tokens per model turn.")] = 512,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="0 decodes greedily.")] = 0.0,
    concurrency: Annotated[
        int, typer.Option("--concurrency", min=1, help="Episodes in flight at once.")
    ] = 64,
    device: DeviceOption = "auto",
    dtype: DTypeOption = "float32",
    kv_cache_mib: Annotated[
        int, typer.Option("--kv-cache-mib", min=16, help="KV cache of the engine.")
    ] = 1024,
    max_model_len: MaxModelLenOption = None,
    rope_scaling: RopeScalingOption = None,
    out_dir: Annotated[
        Path, typer.Option("--out-dir", help="Where the JSONL and summary are written.")
    ] = Path("runs"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object.")] = False,
) -> None:
    """Run episodes through a model: per-domain mean reward, pass rate, tokens and sandbox time."""
    with user_errors():
        if base_url is None:  # before the environments and the model: a typo fails at once
            from tether.models.config import RopeScaling
            from tether.models.precision import DType, resolve_device

            resolve_device(device, "--device")
            DType.parse(dtype, "--dtype")
            if rope_scaling is not None:
                RopeScaling.parse(rope_scaling)
        options = EvalSettings(max_tokens, temperature, seed, concurrency)
        settings = state(ctx).settings()
        registry = default_registry()
        mixture = parse_env_spec(registry, envs)
        plan = plan_episodes(mixture, count, seed, per_env=not envs.startswith("@"))
        provider = sandbox_provider(settings)
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        episodes_path = out_dir / f"eval-{stamp}-{os.getpid()}.jsonl"
        client = open_eval_client(
            model,
            base_url,
            api_key,
            settings.cache_dir,
            device,
            dtype,
            kv_cache_mib,
            max_model_len,
            rope_scaling,
        )
        records = asyncio.run(_run(registry, plan, client, provider, options, episodes_path))
    rows = summarise(records)
    errors = [record for record in records if record.error is not None]
    summary: dict[str, Any] = {
        "model": model,
        "base_url": base_url,
        "envs": envs,
        "episodes": len(records),
        "mean_reward": sum(r.reward for r in records) / len(records),
        "pass_rate": sum(bool(r.score and r.score.passed) for r in records) / len(records),
        "errors": len(errors),
        "episodes_file": str(episodes_path),
        "domains": [row.to_dict() for row in rows],
    }
    summary_path = episodes_path.with_suffix(".json")
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    if as_json:
        print_json(summary)
    else:
        console.print(summary_table(rows, f"eval: {model}"))
        console.print(f"episodes: {episodes_path}\nsummary: {summary_path}", highlight=False)
    for record in errors[:5]:
        err_console.print(
            f"[red]episode {record.env} seed {record.seed} failed:[/] {record.error}", highlight=False
        )
    if errors and len(errors) == len(records):
        raise typer.Exit(1)


async def _run(
    registry: EnvRegistry,
    plan: list[tuple[str, int]],
    client: ChatClient,
    provider: SandboxProvider,
    options: EvalSettings,
    path: Path,
) -> list[EpisodeRecord]:
    from tether.chat.openai_client import OpenAIClient  # httpx: loaded once a command runs

    try:
        if isinstance(client, OpenAIClient):
            await client.check_reachable()  # a dead --base-url fails once, before the sandbox starts
        with path.open("w") as sink, counted_lines("episodes", len(plan)) as advance:

            def done(record: EpisodeRecord) -> None:
                sink.write(json.dumps(record.to_dict(), default=str) + "\n")
                sink.flush()
                outcome = f"failed: {record.error}" if record.error else f"reward {record.reward:.3f}"
                advance(f"{record.env} seed {record.seed} {outcome} ({record.wall_s:.1f} s)")

            async with provider:
                return await run_eval(registry, plan, client, ScoringContext(provider), options, done)
    finally:
        await client.close()
