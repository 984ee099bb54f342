"""The long-context benchmark (`tether engine bench --long`): one model with scaled RoPE (YaRN, factor 4
by default) served at `max_context` tokens, measured on block-wise prefill attention, the KV tiers and
decode speed at growing contexts, in one run.

Every engine is the same long-context server (YaRN, `max_context`, the same KV cache and tiers); only
`attention_block_tokens` differs between the two prefill variants. Each part runs in a process of its
own, so its peak resident set is its own and a restart is a real one:

1. `dense`: the long prompt prefilled with block-wise attention off (each chunk's whole [heads, Q, K]
   score matrix at once): prefill seconds, peak RSS and its growth over the prefill.
2. `tiers`: the same prompt with block-wise attention on (the same figures, and its first-token time is
   the cost of recomputing the prefix), then decode at `short_context_tokens` and at the prompt's length;
   a filler of distinct prompts as large as the device cache pushes the prompt's prefix into the host
   tier, and the prefix with another question is timed from there; a filler as large as the device cache
   and the host tier together then pushes it on to the disk tier.
3. `restart`: a new process on the same disk folder times the prefix with the second question again, from
   the disk tier. Then decode at `max_context`: a real prefill that long takes most of an hour on two CPU
   cores, so this decodes over a synthetic context (a block table of `max_context` tokens over the cache,
   whose KV is not one prompt's: a decode step's cost depends on the context's length, not its values);
   the same synthetic decode at the two shorter contexts shows how close it comes to the real one.

With `full`, two more processes prefill a `max_context` prompt, block-wise on and off, and decode after it
for real. Attention's own peak memory is computed from the tile shapes (`attention_peak_bytes`); the RSS
figures measure the whole process. The benchmark measures; it prints nothing.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import queue
import random
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from tether.engine.bench_machine import (
    MIB,
    bench_threads,
    busy_warnings,
    load_average,
    machine_info,
    peak_rss_mib,
    reset_peak_rss,
    rss_mib,
)
from tether.engine.context_limits import kv_bytes_per_token, resolve_max_model_len
from tether.engine.llm_engine import LLMEngine
from tether.engine.model_runner import SequenceChunk
from tether.engine.sampling import SamplingParams
from tether.errors import ConfigError, TetherError
from tether.models.config import ModelConfig, RopeScaling
from tether.models.loader import load_tokenizer, resolve
from tether.models.quantize import REFERENCE_TEXT

Progress = Callable[[str], None]
Figures = dict[str, Any]

# Tokens of each filler prompt: short enough that its own attention costs little, so a filler's time is
# the model's per-token work; each is random, so it shares no prefix-cache block with anything else.
FILLER_PROMPT_TOKENS = 1024
QUESTIONS = (" What happened in the morning?", " What happened in the evening?")
GOALS = {"attention_memory_reduction": 8.0, "host_tier_ttft_speedup": 5.0}


@dataclass(frozen=True, slots=True)
class LongBenchConfig:
    model: str | Path = "smollm2-135m-instruct"
    """A registered model name or a Hugging Face folder."""
    cache_dir: Path | None = None
    """Model cache root (default: the settings' cache_dir)."""
    rope_scaling: str = "yarn:4"
    """RoPE scaling of every engine, in `RopeScaling.parse`'s form."""
    max_context: int = 32768
    """max_model_len of every engine; the KV cache holds one sequence this long."""
    prompt_tokens: int = 16384
    """The long prompt's shared prefix: the block-wise comparison and the tiers' repeated prefix."""
    short_context_tokens: int = 4096
    """The shortest context decode speed is measured at."""
    decode_tokens: int = 32
    """Tokens decoded at each context."""
    chunk_tokens: int = 512
    """Prefill chunk (the engine's max_num_batched_tokens): the Q of every attention tile."""
    attention_block_tokens: int = 512
    """KV tokens per tile of the block-wise variant."""
    full: bool = False
    """Also prefill a `max_context` prompt (both variants) and decode after it for real."""
    threads: int | None = None
    """Torch threads of every process; None: the cores idle at the start."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "max_context",
            "prompt_tokens",
            "short_context_tokens",
            "decode_tokens",
            "chunk_tokens",
            "attention_block_tokens",
            "threads",
        ):
            value = getattr(self, name)
            if value is None and name == "threads":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"long bench: {name} = {value!r}: expected an integer of at least 1")
        if not self.short_context_tokens < self.prompt_tokens < self.max_context - self.decode_tokens - 64:
            raise ConfigError(
                f"long bench: expected short_context_tokens ({self.short_context_tokens}) < prompt_tokens "
                f"({self.prompt_tokens}) < max_context - decode_tokens - 64 "
                f"({self.max_context - self.decode_tokens - 64}): room for a question and the decode"
            )
        RopeScaling.parse(self.rope_scaling)  # a bad spec fails here, before any process starts


class Part(Enum):
    """The processes of a run (see the module docstring)."""

    DENSE = "dense"
    TIERS = "tiers"
    RESTART = "restart"
    FULL_DENSE = "full-dense"
    FULL_BLOCKWISE = "full-blockwise"


@dataclass(frozen=True, slots=True)
class Setup:
    """What every process of a run shares: the config (threads resolved) and the sizes derived from it."""

    config: LongBenchConfig
    folder: Path
    workdir: Path
    kv_bytes_per_token: int
    kv_cache_mib: int
    host_tier_mib: int
    disk_tier_mib: int

    @classmethod
    def plan(cls, config: LongBenchConfig, folder: Path, workdir: Path) -> Setup:
        """Size the cache to one `max_context` sequence and the host tier to the prompt's KV and a quarter;
        the disk tier holds everything the fillers push out (the prefix first)."""
        per_token = kv_bytes_per_token(ModelConfig.from_folder(folder), torch.float32)
        cache_tokens = config.max_context + config.decode_tokens + 64
        host_tokens = config.prompt_tokens * 5 // 4
        return cls(
            config=config,
            folder=folder,
            workdir=workdir,
            kv_bytes_per_token=per_token,
            kv_cache_mib=math.ceil(cache_tokens * per_token / MIB),
            host_tier_mib=math.ceil(host_tokens * per_token / MIB),
            disk_tier_mib=math.ceil((cache_tokens + 2 * host_tokens) * per_token / MIB),
        )

    def open_engine(self, block_tokens: int, disk: str) -> LLMEngine:
        """The long-context server every part measures; `block_tokens` 0 turns block-wise attention off."""
        engine, _ = LLMEngine.from_pretrained(
            self.folder,
            kv_cache_mib=self.kv_cache_mib,
            seed=self.config.seed,
            rope_scaling=RopeScaling.parse(self.config.rope_scaling),
            max_model_len=self.config.max_context,
            max_num_batched_tokens=self.config.chunk_tokens,
            attention_block_tokens=block_tokens,
            kv_host_tier_mib=self.host_tier_mib,
            kv_disk_tier_dir=str(self.workdir / disk),
            kv_disk_tier_mib=self.disk_tier_mib,
        )
        return engine

    def prompt(self, tokens: int, question: int) -> list[int]:
        """`tokens` tokens of the reference text, repeated (the shared prefix), then question 0 or 1."""
        text, questions = _reference_ids(self.folder)
        return (text * (tokens // len(text) + 1))[:tokens] + questions[question]


@functools.cache
def _reference_ids(folder: Path) -> tuple[list[int], tuple[list[int], ...]]:
    """The reference text's and the questions' token ids under the folder's tokenizer."""
    tokenizer = load_tokenizer(folder)

    def encode(text: str) -> list[int]:
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

    return encode(REFERENCE_TEXT), tuple(encode(question) for question in QUESTIONS)


def attention_peak_bytes(heads: int, query_tokens: int, context_tokens: int, block_tokens: int) -> int:
    """float32 score tile one chunk's attention holds at once: [heads, Q, K] over the whole context with
    block-wise attention off (block_tokens 0), one [heads, tile, tile] tile with it on."""
    if block_tokens == 0:
        return heads * query_tokens * context_tokens * 4
    tile = min(block_tokens, query_tokens, context_tokens)
    return heads * tile * tile * 4


def first_token_and_decode(
    engine: LLMEngine, prompt: list[int], decode_tokens: int
) -> tuple[float, float, int]:
    """(seconds to the first token, decode tokens/s after it, prompt tokens found cached), greedy, EOS
    ignored; decode_tokens 0 stops at the first token (tokens/s is then 0)."""
    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0, ignore_eos=True)
    request_id = f"long-{time.monotonic_ns()}"
    started = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    first = 0.0
    cached = 0
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == request_id and not first and output.completions[0].token_ids:
                first = time.perf_counter()
                cached = output.num_cached_tokens
    decoding = time.perf_counter() - first
    return first - started, (decode_tokens / decoding if decode_tokens else 0.0), cached


def random_prompt(engine: LLMEngine, tokens: int, rng: random.Random) -> list[int]:
    """Random token ids: a prompt that shares no prefix-cache block with any other."""
    return [rng.randrange(engine.vocab_size) for _ in range(tokens)]


def fill(engine: LLMEngine, tokens: int, rng: random.Random) -> None:
    """Prefill distinct random prompts of `tokens` tokens in all, which takes as many fresh KV blocks."""
    each = min(FILLER_PROMPT_TOKENS, engine.config.max_model_len // 2)
    prompts = [random_prompt(engine, each, rng) for _ in range(-(-tokens // each))]
    engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0))


def synthetic_decode_tok_s(engine: LLMEngine, context_tokens: int, steps: int) -> float:
    """Decode tokens/s of one sequence at `context_tokens`, over a block table of the cache's first blocks
    whatever their KV; the engine's prefix cache is emptied first, as these steps overwrite blocks."""
    engine.block_manager.invalidate_prefix_cache()
    runner = engine.runner
    table = list(range(-(-(context_tokens + steps) // runner.block_size)))
    assert len(table) <= runner.kv_cache.num_blocks, "the cache holds the synthetic context"
    started = time.perf_counter()
    for step in range(steps):
        runner.step([SequenceChunk([1], context_tokens - 1 + step, table)])
    return steps / (time.perf_counter() - started)


def prefill_figures(setup: Setup, engine: LLMEngine, prompt: list[int], decode: bool) -> Figures:
    """Prefill `prompt` (after a short warm-up) and decode after it when asked, with the peak RSS."""
    first_token_and_decode(engine, random_prompt(engine, 64, random.Random(-1)), 1)  # warm-up
    reset_peak_rss()
    before = rss_mib()
    ttft, tok_s, _ = first_token_and_decode(engine, prompt, setup.config.decode_tokens if decode else 0)
    peak = peak_rss_mib()
    figures = {
        "prefill_s": ttft,
        "rss_before_mib": before,
        "peak_rss_mib": peak,
        "rss_growth_mib": peak - before,
    }
    return figures | ({"decode_tok_s": tok_s} if decode else {})


def run_dense(setup: Setup, say: Progress, prompt_tokens: int, decode: bool) -> Figures:
    engine = setup.open_engine(0, "dense-disk")
    say(f"prefill of {prompt_tokens} tokens, block-wise attention off")
    return prefill_figures(setup, engine, setup.prompt(prompt_tokens, 0), decode)


def run_blockwise(setup: Setup, say: Progress, prompt_tokens: int, decode: bool) -> Figures:
    engine = setup.open_engine(setup.config.attention_block_tokens, "full-disk")
    say(f"prefill of {prompt_tokens} tokens, block-wise attention on")
    return prefill_figures(setup, engine, setup.prompt(prompt_tokens, 0), decode)


def run_tiers(setup: Setup, say: Progress) -> Figures:
    config = setup.config
    engine = setup.open_engine(config.attention_block_tokens, "disk")
    rng = random.Random(config.seed)
    say(f"prefill of {config.prompt_tokens} tokens, block-wise attention on, then decode")
    figures = prefill_figures(setup, engine, setup.prompt(config.prompt_tokens, 0), decode=True)
    second = setup.prompt(config.prompt_tokens, 1)
    figures["device_ttft_s"], _, figures["device_cached_tokens"] = first_token_and_decode(engine, second, 0)
    say(f"decode at {config.short_context_tokens} tokens")
    short = random_prompt(engine, config.short_context_tokens, rng)
    figures["short_decode_tok_s"] = first_token_and_decode(engine, short, config.decode_tokens)[1]
    device_tokens = engine.config.num_blocks * engine.config.block_size
    say(f"filler of {device_tokens} tokens: the prefix out of the device cache into the host tier")
    fill(engine, device_tokens, rng)
    say("the prefix again, from the host tier")
    figures["host_ttft_s"], _, figures["host_cached_tokens"] = first_token_and_decode(engine, second, 0)
    host_tokens = setup.host_tier_mib * MIB // setup.kv_bytes_per_token
    say(f"filler of {device_tokens + host_tokens} tokens: the prefix on to the disk tier")
    fill(engine, device_tokens + host_tokens, rng)
    return figures


def run_restart(setup: Setup, say: Progress) -> Figures:
    config = setup.config
    engine = setup.open_engine(config.attention_block_tokens, "disk")
    say("the prefix again after a restart, from the disk tier")
    second = setup.prompt(config.prompt_tokens, 1)
    figures: Figures = {"max_context": engine.config.max_model_len}
    figures["disk_ttft_s"], _, figures["disk_cached_tokens"] = first_token_and_decode(engine, second, 0)
    synthetic = {}
    for context in (
        config.short_context_tokens,
        config.prompt_tokens,
        config.max_context - config.decode_tokens,
    ):
        say(f"decode over a synthetic context of {context} tokens")
        synthetic[context] = synthetic_decode_tok_s(engine, context, config.decode_tokens)
    figures["synthetic_decode_tok_s"] = synthetic
    return figures


PARTS: dict[Part, Callable[[Setup, Progress], Figures]] = {
    Part.DENSE: lambda setup, say: run_dense(setup, say, setup.config.prompt_tokens, decode=False),
    Part.TIERS: run_tiers,
    Part.RESTART: run_restart,
    Part.FULL_DENSE: lambda setup, say: run_dense(setup, say, full_prompt_tokens(setup.config), False),
    Part.FULL_BLOCKWISE: lambda setup, say: run_blockwise(setup, say, full_prompt_tokens(setup.config), True),
}


def full_prompt_tokens(config: LongBenchConfig) -> int:
    """The `full` prompt's prefix: `max_context` less room for a question and the decode, in whole chunks."""
    return (config.max_context - config.decode_tokens - 64) // config.chunk_tokens * config.chunk_tokens


def _part_main(part: Part, setup: Setup, messages: Any) -> None:
    """A part's process: its figures, or its error, through `messages`; progress lines as it goes."""
    try:
        assert setup.config.threads is not None, "the parent resolved the threads"
        torch.set_num_threads(setup.config.threads)
        figures = PARTS[part](setup, lambda line: messages.put(("progress", line)))
        messages.put(("result", figures | {"load_average_end": load_average()}))
    except TetherError as error:
        messages.put(("user-error", error))
    except BaseException:  # reported to the parent, which raises it
        messages.put(("error", traceback.format_exc()))


def run_part(part: Part, setup: Setup, say: Progress) -> Figures:
    """Run one part in a fresh (spawned) process and return its figures; its progress goes to `say`."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    process = context.Process(
        target=_part_main, args=(part, setup, messages), name=f"long-bench-{part.value}"
    )
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
                return dict(payload)
            elif kind == "user-error":
                raise payload
            else:
                raise RuntimeError(f"long bench: the {part.value} process failed:\n{payload}")
    finally:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
            process.join()


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.inf


def run_long_bench(config: LongBenchConfig, progress: Progress | None = None) -> Figures:
    """Every part in turn; returns one JSON-ready dict (see the module docstring)."""
    say = progress or (lambda _line: None)
    started = time.perf_counter()
    load_start = load_average()
    config = replace(config, threads=bench_threads(config.threads))
    folder = resolve(config.model, config.cache_dir)
    model_config = ModelConfig.from_folder(folder)
    workdir = Path(tempfile.mkdtemp(prefix="tether-long-bench-"))
    try:
        setup = Setup.plan(config, folder, workdir)
        scaled = replace(model_config, rope_scaling=RopeScaling.parse(config.rope_scaling))
        resolve_max_model_len(scaled, config.max_context, setup.kv_cache_mib, 16, torch.float32)
        parts = [Part.DENSE, Part.TIERS, Part.RESTART]
        parts += [Part.FULL_DENSE, Part.FULL_BLOCKWISE] if config.full else []
        results = {part: run_part(part, setup, say) for part in parts}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return assemble(config, setup, model_config, results, load_start, started)


def assemble(
    config: LongBenchConfig,
    setup: Setup,
    model_config: ModelConfig,
    results: dict[Part, Figures],
    load_start: float,
    started: float,
) -> Figures:
    """The flat figures, the nested details and the warnings from every part's results."""
    dense, tiers, restart = results[Part.DENSE], results[Part.TIERS], results[Part.RESTART]
    heads = model_config.num_heads
    peaks = {
        name: attention_peak_bytes(heads, config.chunk_tokens, config.prompt_tokens, block)
        for name, block in (("blockwise", config.attention_block_tokens), ("dense", 0))
    }
    recompute = tiers["prefill_s"]
    decode = {
        str(config.short_context_tokens): tiers["short_decode_tok_s"],
        str(config.prompt_tokens): tiers["decode_tok_s"],
        str(config.max_context): results[Part.FULL_BLOCKWISE]["decode_tok_s"]
        if config.full
        else restart["synthetic_decode_tok_s"][config.max_context - config.decode_tokens],
    }
    figures: Figures = {
        "model": str(config.model),
        "rope_scaling": config.rope_scaling,
        "max_context": restart["max_context"],
        "kv_bytes_per_token": setup.kv_bytes_per_token,
        "kv_cache_mib": setup.kv_cache_mib,
        "prompt_tokens": config.prompt_tokens,
        "chunk_tokens": config.chunk_tokens,
        "attention_block_tokens": config.attention_block_tokens,
        "attention_memory_reduction": ratio(peaks["dense"], peaks["blockwise"]),
        "attention_peak_mib": {name: peak / MIB for name, peak in peaks.items()},
        "prefill_s": {"blockwise": tiers["prefill_s"], "dense": dense["prefill_s"]},
        "peak_rss_mib": {"blockwise": tiers["peak_rss_mib"], "dense": dense["peak_rss_mib"]},
        "prefill_rss_growth_mib": {"blockwise": tiers["rss_growth_mib"], "dense": dense["rss_growth_mib"]},
        "recompute_ttft_ms": 1000 * recompute,
        "device_tier_ttft_ms": 1000 * tiers["device_ttft_s"],
        "host_tier_ttft_ms": 1000 * tiers["host_ttft_s"],
        "disk_tier_ttft_ms": 1000 * restart["disk_ttft_s"],
        "host_tier_cached_tokens": tiers["host_cached_tokens"],
        "disk_tier_cached_tokens": restart["disk_cached_tokens"],
        "host_tier_ttft_speedup": ratio(recompute, tiers["host_ttft_s"]),
        "disk_tier_ttft_speedup": ratio(recompute, restart["disk_ttft_s"]),
        "decode_tok_s_by_context": decode,
        "decode_context": {
            str(config.short_context_tokens): "prompt",
            str(config.prompt_tokens): "prompt",
            str(config.max_context): "prompt" if config.full else "synthetic",
        },
        "synthetic_decode_tok_s_by_context": {
            str(k): v for k, v in restart["synthetic_decode_tok_s"].items()
        },
    }
    if config.full:
        full_dense, full_blockwise = results[Part.FULL_DENSE], results[Part.FULL_BLOCKWISE]
        figures["full_prompt_tokens"] = full_prompt_tokens(config)
        figures["full_prefill_s"] = {
            "blockwise": full_blockwise["prefill_s"],
            "dense": full_dense["prefill_s"],
        }
        figures["full_peak_rss_mib"] = {
            "blockwise": full_blockwise["peak_rss_mib"],
            "dense": full_dense["peak_rss_mib"],
        }
    assert config.threads is not None
    loads = {"at the start": load_start} | {
        f"after {part.value}": r["load_average_end"] for part, r in results.items()
    }
    warnings = busy_warnings(config.threads, loads)
    warnings += [
        f"{key} = {figures[key]:.3g}: below the goal of {goal:g}"
        for key, goal in GOALS.items()
        if figures[key] < goal
    ]
    for tier in ("host", "disk"):
        if figures[f"{tier}_tier_cached_tokens"] < config.prompt_tokens:
            warnings.append(
                f"{tier} tier: {figures[f'{tier}_tier_cached_tokens']} of the {config.prompt_tokens}-token "
                "prefix came from cache"
            )
    figures["machine"] = machine_info(config.threads, load_start, load_average())
    figures["warnings"] = warnings
    figures["duration_s"] = time.perf_counter() - started
    return figures
