"""`tether engine ...`: benchmark the inference engine on a real model against its baselines."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tether.cli.common import CacheDirOption, cache_root, err_console, phases, print_json, user_errors
from tether.errors import ConfigError
from tether.machine import warn_if_busy

app = typer.Typer(help="The inference engine: benchmarks.", no_args_is_help=True)
console = Console()


@app.callback()
def main() -> None:
    """The inference engine: benchmarks."""


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return "-" if value is None else str(value)


class Peer(StrEnum):
    LLAMA_CPP = "llama-cpp"


def parse_streams(text: str) -> tuple[int, ...]:
    """`--streams 1,16,32` as integers; a `ConfigError` naming the bad value otherwise."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--streams {text!r}: expected comma-separated integers, e.g. 1,16,32") from None
    if any(value < 1 for value in values):
        raise ConfigError(f"--streams {text!r}: every stream count must be at least 1")
    return values


@app.command("bench")
def bench_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Option("--model", help="Registered model name or HF folder.")] = (
        "smollm2-135m-instruct"
    ),
    requests: Annotated[int, typer.Option("--requests", help="Requests in the throughput workload.")] = 64,
    min_output: Annotated[int, typer.Option("--min-output", help="Shortest output, in tokens.")] = 16,
    max_output: Annotated[int, typer.Option("--max-output", help="Longest output, in tokens.")] = 192,
    prefix_tokens: Annotated[
        int, typer.Option("--prefix-tokens", help="Shared prefix of the time-to-first-token test.")
    ] = 1024,
    repeats: Annotated[int, typer.Option("--repeats", help="Repeats; every figure is a median.")] = 3,
    spec_tokens: Annotated[
        int, typer.Option("--spec-tokens", help="Draft tokens per step of the speculation measurement.")
    ] = 8,
    spec_max_output: Annotated[
        int, typer.Option("--spec-max-output", help="Output cap of each copy task (speculation).")
    ] = 256,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the output lengths.")] = 0,
    lanes: Annotated[
        int, typer.Option("--lanes", help="Data-parallel lanes of the engines (see ModelRunner).")
    ] = 1,
    threads: Annotated[
        int | None,
        typer.Option("--threads", help="Torch threads (default: the cores idle at the start)."),
    ] = None,
    structured: Annotated[
        bool,
        typer.Option(
            "--structured",
            help="Measure constrained decoding instead: random JSON schemas, validity and overhead.",
        ),
    ] = False,
    schemas: Annotated[int, typer.Option("--schemas", help="Random schemas (--structured).")] = 50,
    schema_max_tokens: Annotated[
        int, typer.Option("--schema-max-tokens", help="Output budget per schema (--structured).")
    ] = 512,
    long: Annotated[
        bool,
        typer.Option(
            "--long",
            help="Measure long context instead: YaRN context, block-wise prefill attention against full, "
            "TTFT from the host and disk KV tiers against recomputing, decode speed by context.",
        ),
    ] = False,
    full: Annotated[
        bool, typer.Option("--full", help="Also prefill and decode a max-context prompt (--long; slow).")
    ] = False,
    max_context: Annotated[
        int, typer.Option("--max-context", help="max_model_len of the engines (--long).")
    ] = 32768,
    long_prompt_tokens: Annotated[
        int, typer.Option("--long-prompt-tokens", help="The long prompt's shared prefix (--long).")
    ] = 16384,
    rope_scaling: Annotated[
        str, typer.Option("--rope-scaling", help="RoPE scaling of the engines, e.g. yarn:4 (--long).")
    ] = "yarn:4",
    peer: Annotated[
        Peer | None,
        typer.Option(
            "--peer",
            help="Measure `tether serve` against another server instead: llama-cpp runs llama.cpp's "
            "llama-server on the same weights (float32 GGUF and the shipped Q4_1) at the same threads, "
            "against tether in float32 and with int8 weights.",
        ),
    ] = None,
    llama_server: Annotated[
        Path | None,
        typer.Option(
            "--llama-server", help="llama-server binary (--peer; default: on PATH, else the cache's)."
        ),
    ] = None,
    gguf: Annotated[
        Path | None,
        typer.Option("--gguf", help="Quantized GGUF llama-server serves (--peer; default: the model's own)."),
    ] = None,
    streams: Annotated[
        str,
        typer.Option("--streams", help="Concurrent streams of each measurement, comma-separated (--peer)."),
    ] = "1,16,32",
    peer_tokens: Annotated[
        int, typer.Option("--peer-tokens", help="Greedy tokens per request (--peer).")
    ] = 64,
    kv_cache_dtype: Annotated[
        str,
        typer.Option(
            "--kv-cache-dtype",
            help="tether's KV cache (--peer): float32 as its weights, or float16 as llama-server's default.",
        ),
    ] = "float32",
    cache_dir: CacheDirOption = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Also write the JSON result to this file.")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of a table.")
    ] = False,
) -> None:
    """Throughput against transformers, prefix-cache TTFT, int8 weights and greedy parity, in one process;
    with --structured, JSON-schema validity and the constrained decoding overhead instead; with --long,
    long-context figures instead (one process per part); with --peer llama-cpp, `tether serve` against
    llama.cpp's llama-server instead (--repeats interleaved rounds)."""
    if peer is Peer.LLAMA_CPP:
        with user_errors():
            from tether.serving.peer_bench import PeerBenchConfig, run_peer_bench

            peer_config = PeerBenchConfig(
                model=model,
                cache_dir=cache_root(ctx, cache_dir),
                llama_server=llama_server,
                gguf=gguf,
                threads=threads,
                streams=parse_streams(streams),
                max_tokens=peer_tokens,
                rounds=repeats,
                prefix_tokens=prefix_tokens,
                kv_cache_dtype=kv_cache_dtype,
            )
            with progress_lines() as report:
                result = run_peer_bench(peer_config, report)
        _show(result, f"engine bench --peer llama-cpp: {model}", out, as_json)
        return
    if long:
        with user_errors():
            from tether.engine.long_bench import LongBenchConfig, run_long_bench

            long_config = LongBenchConfig(
                model=model,
                cache_dir=cache_root(ctx, cache_dir),
                rope_scaling=rope_scaling,
                max_context=max_context,
                prompt_tokens=long_prompt_tokens,
                full=full,
                threads=threads,
                seed=seed,
            )
            with progress_lines() as report:
                result = run_long_bench(long_config, report)
        _show(result, f"engine bench --long: {model}", out, as_json)
        return
    if structured:
        with user_errors():
            from tether.engine.structured_bench import StructuredBenchConfig, run_structured_bench

            structured_config = StructuredBenchConfig(
                model=model,
                cache_dir=cache_root(ctx, cache_dir),
                schemas=schemas,
                max_tokens=schema_max_tokens,
                repeats=repeats,
                seed=seed,
                threads=threads,
            )
            with progress_lines() as report:
                result = run_structured_bench(structured_config, report)
        _show(result, f"engine bench --structured: {model}", out, as_json)
        return
    with user_errors():
        from tether.engine.bench import BenchConfig, run_bench  # torch: loaded only when benchmarking

        config = BenchConfig(
            model=model,
            cache_dir=cache_root(ctx, cache_dir),
            requests=requests,
            min_output=min_output,
            max_output=max_output,
            prefix_tokens=prefix_tokens,
            repeats=repeats,
            spec_tokens=spec_tokens,
            spec_max_output=spec_max_output,
            seed=seed,
            lanes=lanes,
            threads=threads,
        )
        with phases() as report:
            result = run_bench(config, report)
    _show(result, f"engine bench: {model}", out, as_json)


@contextmanager
def progress_lines() -> Iterator[Callable[[str], None]]:
    """A spinner naming the phase on a terminal; otherwise plain stderr lines, which a log shows as they
    happen."""
    if err_console.is_terminal:
        with phases() as report:
            yield report
    else:
        yield lambda line: err_console.print(line, highlight=False)


def _rows(result: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(figure, value) rows, a nested dict's entries as `key.inner`."""
    for key, value in result.items():
        if isinstance(value, dict):
            yield from _rows(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _show(result: dict[str, Any], title: str, out: Path | None, as_json: bool) -> None:
    warn_if_busy(result["machine"])
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        print_json(result)
        return
    table = Table(title=title)
    table.add_column("figure", no_wrap=True)
    table.add_column("value", justify="right")
    for key, value in _rows(result):
        table.add_row(key, _format(value))
    console.print(table)
