"""The long-context benchmark (`tether engine bench --long`): YaRN context, block-wise prefill attention,
the KV tiers and decode speed by context, on one model in one run (`long_bench_parts.py` says what each
part measures).

Each part runs in a spawned process of its own: its peak resident set is then its own, not the high-water
mark of what ran before, and the restart the disk tier is timed after is a real one. Attention's own peak
memory (`attention_memory_reduction`) is computed from the tile shapes the engine uses
(`attention_peak_bytes`); the RSS figures measure the whole process around the same prefill. The
benchmark measures; it prints nothing.
"""

from __future__ import annotations

import math
import multiprocessing
import queue
import shutil
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tether.engine.bench_machine import bench_threads, machine_info
from tether.engine.context_limits import resolve_max_model_len
from tether.engine.long_bench_parts import PARTS, Figures, LongBenchConfig, Part, Progress, Setup
from tether.errors import TetherError
from tether.machine import MIB, load_average
from tether.models.config import ModelConfig, RopeScaling
from tether.models.loader import resolve

__all__ = ["LongBenchConfig", "attention_peak_bytes", "run_long_bench"]

GOALS = {"attention_memory_reduction": 8.0, "host_tier_ttft_speedup": 5.0}
"""The issue's goals; a figure below its goal is named in the result's warnings."""
PART_EXIT_S = 60


def attention_peak_bytes(heads: int, query_tokens: int, context_tokens: int, block_tokens: int) -> int:
    """The float32 scores one long chunk's attention holds at once: the whole [heads, Q, K] matrix over
    the context with block-wise attention off (block_tokens 0), one [heads, tile, tile] tile with it on
    (`tether.kernels.blockwise`: query and KV tiles of block_tokens)."""
    if block_tokens == 0:
        return heads * query_tokens * context_tokens * 4
    return heads * min(block_tokens, query_tokens) * min(block_tokens, context_tokens) * 4


def _part_main(part: Part, setup: Setup, messages: Any) -> None:
    """A part's process: progress lines as it goes, then its figures or its error, through `messages`."""
    try:
        assert setup.config.threads is not None, "the parent resolved the threads"
        torch.set_num_threads(setup.config.threads)
        figures = PARTS[part](setup, lambda line: messages.put(("progress", line)))
        messages.put(("result", figures | {"load_average_end": load_average()}))
    except TetherError as error:  # a user error: the parent raises it as it is
        messages.put(("user-error", error))
    except BaseException:
        messages.put(("error", traceback.format_exc()))


def run_part(part: Part, setup: Setup, say: Progress) -> Figures:
    """One part in a fresh (spawned) process; returns its figures, its progress lines going to `say`."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    process = context.Process(
        target=_part_main, args=(part, setup, messages), name=f"long-bench-{part.value}"
    )
    started = time.perf_counter()
    process.start()
    try:
        while True:
            try:
                kind, payload = messages.get(timeout=1.0)
            except queue.Empty:
                if not process.is_alive():
                    raise RuntimeError(
                        f"long bench: the {part.value} process ended (exit code {process.exitcode}) "
                        "without figures"
                    ) from None
                continue
            if kind == "progress":
                say(f"{part.value}: {payload}")
            elif kind == "result":
                figures = dict(payload) | {"part_s": time.perf_counter() - started}
                say(f"{part.value}: done: {summary(figures)}")
                return figures
            elif kind == "user-error":
                raise payload
            else:
                raise RuntimeError(f"long bench: the {part.value} process failed:\n{payload}")
    finally:
        process.join(timeout=PART_EXIT_S)
        if process.is_alive():
            process.kill()
            process.join()


def summary(figures: Figures) -> str:
    """A part's scalar figures on one line, so a run cut short still shows what it measured."""
    return ", ".join(f"{key} {value:.4g}" for key, value in figures.items() if isinstance(value, int | float))


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.inf


def run_long_bench(config: LongBenchConfig, progress: Progress | None = None) -> Figures:
    """Every part in turn; one JSON-ready dict of figures, the machine and warnings."""
    say = progress or (lambda _line: None)
    started = time.perf_counter()
    load_start = load_average()
    config = replace(config, threads=bench_threads(config.threads))
    folder = resolve(config.model, config.cache_dir)
    model_config = ModelConfig.from_folder(folder).with_rope_scaling(RopeScaling.parse(config.rope_scaling))
    workdir = Path(tempfile.mkdtemp(prefix="tether-long-bench-"))
    try:
        setup = Setup.plan(config, folder, workdir)
        # What the engines would refuse, refused before the first process starts.
        resolve_max_model_len(model_config, config.max_context, setup.kv_cache_mib, 16, torch.float32)
        parts = [Part.DENSE, Part.TIERS, Part.RESTART]
        parts += [Part.FULL_DENSE, Part.FULL_BLOCKWISE] if config.full else []
        results = {part: run_part(part, setup, say) for part in parts}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    figures = assemble(config, setup, model_config, results)
    assert config.threads is not None
    loads = {f"after {part.value}": result["load_average_end"] for part, result in results.items()}
    machine = machine_info(config.threads, load_start, loads)
    figures["warnings"] = machine["busy_warnings"] + goal_warnings(config, figures)
    figures["part_s"] = {part.value: result["part_s"] for part, result in results.items()}
    figures["machine"] = machine
    figures["duration_s"] = time.perf_counter() - started
    return figures


def assemble(
    config: LongBenchConfig, setup: Setup, model_config: ModelConfig, results: dict[Part, Figures]
) -> Figures:
    """The headline figures first, then the details they come from."""
    dense, tiers, restart = results[Part.DENSE], results[Part.TIERS], results[Part.RESTART]
    peaks = {
        variant: attention_peak_bytes(
            model_config.num_heads, config.chunk_tokens, config.prompt_tokens, block
        )
        for variant, block in (("blockwise", config.attention_block_tokens), ("dense", 0))
    }
    recompute = tiers["prefill_s"]
    longest = str(config.max_context)
    decode = {
        str(config.short_context): tiers["short_decode_tok_s"],
        str(config.prompt_tokens): tiers["decode_tok_s"],
        longest: results[Part.FULL_BLOCKWISE]["decode_tok_s"]
        if config.full
        else restart["synthetic_decode_tok_s"][longest],
    }
    figures: Figures = {
        "max_context": restart["max_context"],
        "attention_memory_reduction": ratio(peaks["dense"], peaks["blockwise"]),
        "host_tier_ttft_speedup": ratio(recompute, tiers["host_ttft_s"]),
        "disk_tier_ttft_speedup": ratio(recompute, restart["disk_ttft_s"]),
        "decode_tok_s_by_context": decode,
        "decode_context_kind": {context: "prompt" for context in decode}
        | ({} if config.full else {longest: "synthetic"}),
        "model": str(config.model),
        "rope_scaling": config.rope_scaling,
        "kv_bytes_per_token": setup.kv_bytes_per_token,
        "kv_cache_mib": setup.kv_cache_mib,
        "kv_host_tier_mib": setup.host_tier_mib,
        "prompt_tokens": config.prompt_tokens,
        "chunk_tokens": config.chunk_tokens,
        "attention_block_tokens": config.attention_block_tokens,
        "attention_peak_mib": {variant: peak / MIB for variant, peak in peaks.items()},
        "prefill_s": {"blockwise": tiers["prefill_s"], "dense": dense["prefill_s"]},
        "peak_rss_mib": {"blockwise": tiers["peak_rss_mib"], "dense": dense["peak_rss_mib"]},
        "prefill_rss_growth_mib": {"blockwise": tiers["rss_growth_mib"], "dense": dense["rss_growth_mib"]},
        "recompute_ttft_ms": 1000 * recompute,
        "device_tier_ttft_ms": 1000 * tiers["device_ttft_s"],
        "host_tier_ttft_ms": 1000 * tiers["host_ttft_s"],
        "disk_tier_ttft_ms": 1000 * restart["disk_ttft_s"],
        "device_tier_cached_tokens": tiers["device_cached_tokens"],
        "host_tier_cached_tokens": tiers["host_cached_tokens"],
        "disk_tier_cached_tokens": restart["disk_cached_tokens"],
        "synthetic_decode_tok_s_by_context": restart["synthetic_decode_tok_s"],
        "tier_stats": {"tiers": tiers["tier_stats"], "restart": restart["tier_stats"]},
    }
    if config.full:
        full = {"blockwise": results[Part.FULL_BLOCKWISE], "dense": results[Part.FULL_DENSE]}
        figures["full_prompt_tokens"] = config.full_prompt_tokens
        figures["full_prefill_s"] = {variant: part["prefill_s"] for variant, part in full.items()}
        figures["full_peak_rss_mib"] = {variant: part["peak_rss_mib"] for variant, part in full.items()}
    return figures


def goal_warnings(config: LongBenchConfig, figures: Figures) -> list[str]:
    """A line for each figure below the issue's goal and each tier that did not serve the whole prefix."""
    warnings = [
        f"{key} = {figures[key]:.3g}: below the goal of {goal:g}"
        for key, goal in GOALS.items()
        if figures[key] < goal
    ]
    for tier in ("host", "disk"):
        cached = figures[f"{tier}_tier_cached_tokens"]
        if cached < config.prompt_tokens:
            warnings.append(
                f"{tier} tier: {cached} of the {config.prompt_tokens}-token prefix came from cache"
            )
    return warnings
