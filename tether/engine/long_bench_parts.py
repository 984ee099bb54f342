"""What each process of the long-context benchmark (`long_bench.py`) measures, and the one engine they
all measure: scaled RoPE (YaRN, factor 4 by default) served at `max_context` tokens, with a host and a
disk KV tier; only `attention_block_tokens` differs between the two prefill variants.

- `dense`: the long prompt prefilled with block-wise attention off (each long chunk's whole
  [heads, Q, K] score matrix at once): prefill seconds, peak RSS and its growth over the prefill.
- `tiers`: the same with block-wise attention on (its first-token time is also the cost of recomputing
  the prefix), then decode at the prompt's length and at `short_context_tokens`; the prefix with
  another question from the device cache; a filler of distinct prompts as large as the device cache
  pushes the prefix into the host tier, and it is timed from there. The disk tier is written through as
  blocks are computed.
- `restart`: a new process on the same disk folder times the prefix with the second question from the
  disk tier. Then decode at `max_context`: a real prefill that long takes many minutes on two cores, so
  it decodes over a synthetic context (a block table of that many tokens over the cache, whose KV is not
  one prompt's: a decode step's cost depends on the context's length, not on its values); the same at
  the shorter contexts shows how close that comes to decoding after a real prompt.
- `full-dense`, `full-blockwise` (with `full`): a `max_context` prompt, both variants, and a real decode.
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from tether.engine.context_limits import kv_bytes_per_token
from tether.engine.llm_engine import LLMEngine
from tether.engine.model_runner import SequenceChunk
from tether.engine.sampling import SamplingParams
from tether.errors import ConfigError
from tether.machine import MIB, peak_rss_mib, reset_peak_rss, rss_mib
from tether.models.config import ModelConfig, RopeScaling, UnsupportedModelError
from tether.models.loader import load_tokenizer
from tether.models.quantize import REFERENCE_TEXT

Progress = Callable[[str], None]
Figures = dict[str, Any]

# Tokens of each filler prompt: short enough that its own attention costs little, so a filler's time is
# the model's per-token work; each is random, so it shares no prefix-cache block with anything else.
FILLER_PROMPT_TOKENS = 1024
QUESTIONS = (" What happened in the morning?", " What happened in the evening?")
ROOM_TOKENS = 64
"""Context kept free after the longest prompt's prefix for its question."""


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
    short_context_tokens: int | None = None
    """The shortest context decode speed is measured at; None: a quarter of `prompt_tokens`."""
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
        if self.short_context_tokens is None and isinstance(self.prompt_tokens, int):
            object.__setattr__(self, "short_context_tokens", self.prompt_tokens // 4)
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
        longest = self.max_context - self.decode_tokens - ROOM_TOKENS
        assert self.short_context_tokens is not None
        if not self.short_context_tokens < self.prompt_tokens <= longest:
            raise ConfigError(
                f"long bench: expected short_context_tokens ({self.short_context_tokens}) < prompt_tokens "
                f"({self.prompt_tokens}) <= max_context - decode_tokens - {ROOM_TOKENS} ({longest}): "
                "room for a question and the decode"
            )
        try:  # a bad spec fails here, before any process starts
            RopeScaling.parse(self.rope_scaling)
        except UnsupportedModelError as error:
            raise ConfigError(f"long bench: rope_scaling = {self.rope_scaling!r}: {error}") from None

    @property
    def short_context(self) -> int:
        """`short_context_tokens`, as resolved on construction."""
        assert self.short_context_tokens is not None
        return self.short_context_tokens

    @property
    def full_prompt_tokens(self) -> int:
        """The `full` prompt's prefix: `max_context` less room for its question and decode, whole chunks."""
        longest = self.max_context - self.decode_tokens - ROOM_TOKENS
        return max(self.prompt_tokens, longest // self.chunk_tokens * self.chunk_tokens)


class Part(Enum):
    """The processes of a run, in order (see the module docstring)."""

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
        """The cache holds one `max_context` sequence. The host tier holds the cache and a tenth: all the
        filler pushes out of the device (the prefix among it), so none of it moves on to the disk tier. The
        disk tier (written through) holds everything the tiers part computes, with room to spare."""
        per_token = kv_bytes_per_token(ModelConfig.from_folder(folder), torch.float32)
        cache_tokens = config.max_context + config.decode_tokens + ROOM_TOKENS
        return cls(
            config=config,
            folder=folder,
            workdir=workdir,
            kv_bytes_per_token=per_token,
            kv_cache_mib=math.ceil(cache_tokens * per_token / MIB),
            host_tier_mib=math.ceil(cache_tokens * 11 // 10 * per_token / MIB),
            disk_tier_mib=math.ceil(3 * cache_tokens * per_token / MIB) + 1,
        )

    def open_engine(self, block_tokens: int, disk: str) -> LLMEngine:
        """The long-context server every part measures; `block_tokens` 0 turns block-wise attention off;
        `disk` names the disk tier's folder in the run's working folder."""
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


def random_prompt(engine: LLMEngine, tokens: int, rng: random.Random) -> list[int]:
    """Random token ids: a prompt that shares no prefix-cache block with any other."""
    return [rng.randrange(engine.vocab_size) for _ in range(tokens)]


def first_token_and_decode(
    engine: LLMEngine, prompt: list[int], decode_tokens: int = 0
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
            if not first and output.completions[0].token_ids:
                first = time.perf_counter()
                cached = output.num_cached_tokens
    decoding = time.perf_counter() - first
    return first - started, (decode_tokens / decoding if decode_tokens else 0.0), cached


def fill(engine: LLMEngine, tokens: int, rng: random.Random) -> None:
    """Prefill distinct random prompts of `tokens` tokens in all, which takes as many fresh KV blocks."""
    each = min(FILLER_PROMPT_TOKENS, engine.config.max_model_len // 2)
    prompts = [random_prompt(engine, each, rng) for _ in range(-(-tokens // each))]
    engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0))


def synthetic_decode_tok_s(engine: LLMEngine, context_tokens: int, steps: int) -> float:
    """Decode tokens/s of one sequence at `context_tokens`, over a block table of the cache's first blocks
    whatever their KV; the prefix cache is emptied first, as these steps overwrite blocks' KV."""
    engine.block_manager.invalidate_prefix_cache()
    runner = engine.runner
    table = list(range(-(-(context_tokens + steps) // runner.block_size)))
    assert len(table) <= runner.kv_cache.num_blocks, "the cache holds the synthetic context"
    runner.step([SequenceChunk([1], context_tokens - 1, table)])  # warm-up at this length
    started = time.perf_counter()
    for step in range(steps):
        runner.step([SequenceChunk([1], context_tokens + step, table)])
    return steps / (time.perf_counter() - started)


def prefill_figures(engine: LLMEngine, prompt: list[int], decode_tokens: int) -> Figures:
    """Prefill `prompt` (after a short warm-up) and decode after it, with the process's peak RSS."""
    first_token_and_decode(engine, random_prompt(engine, 64, random.Random(-1)), 1)
    reset_peak_rss()
    before = rss_mib()
    ttft, tok_s, _ = first_token_and_decode(engine, prompt, decode_tokens)
    peak = peak_rss_mib()
    figures = {"prefill_s": ttft, "rss_before_mib": before, "peak_rss_mib": peak}
    return figures | {"rss_growth_mib": peak - before, "decode_tok_s": tok_s}


def run_dense(setup: Setup, say: Progress) -> Figures:
    say(f"prefill of {setup.config.prompt_tokens} tokens, block-wise attention off")
    engine = setup.open_engine(0, "dense-disk")
    return prefill_figures(engine, setup.prompt(setup.config.prompt_tokens, 0), 0)


def run_tiers(setup: Setup, say: Progress) -> Figures:
    config = setup.config
    rng = random.Random(config.seed)
    say(f"prefill of {config.prompt_tokens} tokens, block-wise attention on, then decode")
    engine = setup.open_engine(config.attention_block_tokens, "disk")
    figures = prefill_figures(engine, setup.prompt(config.prompt_tokens, 0), config.decode_tokens)
    second = setup.prompt(config.prompt_tokens, 1)
    figures["device_ttft_s"], _, figures["device_cached_tokens"] = first_token_and_decode(engine, second)
    say(f"decode at {config.short_context} tokens")
    short = random_prompt(engine, config.short_context, rng)
    figures["short_decode_tok_s"] = first_token_and_decode(engine, short, config.decode_tokens)[1]
    device_tokens = engine.config.num_blocks * engine.config.block_size
    say(f"filler of {device_tokens} tokens: the prefix out of the device cache into the host tier")
    fill(engine, device_tokens, rng)
    say("the prefix again, from the host tier")
    figures["host_ttft_s"], _, figures["host_cached_tokens"] = first_token_and_decode(engine, second)
    return figures | {"tier_stats": asdict(engine.tier_stats())}


def run_restart(setup: Setup, say: Progress) -> Figures:
    config = setup.config
    say("the prefix again after a restart, from the disk tier")
    engine = setup.open_engine(config.attention_block_tokens, "disk")
    second = setup.prompt(config.prompt_tokens, 1)
    figures: Figures = {"max_context": engine.config.max_model_len}
    figures["disk_ttft_s"], _, figures["disk_cached_tokens"] = first_token_and_decode(engine, second)
    figures["tier_stats"] = asdict(engine.tier_stats())
    synthetic = {}
    for context in (config.short_context, config.prompt_tokens, config.max_context):
        say(f"decode over a synthetic context of {context} tokens")
        start = min(context, config.max_context - config.decode_tokens - 1)
        synthetic[str(context)] = synthetic_decode_tok_s(engine, start, config.decode_tokens)
    return figures | {"synthetic_decode_tok_s": synthetic}


def run_full(setup: Setup, say: Progress, block_tokens: int) -> Figures:
    config = setup.config
    state = "on" if block_tokens else "off"
    say(f"prefill of {config.full_prompt_tokens} tokens, block-wise attention {state}, then decode")
    engine = setup.open_engine(block_tokens, f"full-{state}-disk")
    return prefill_figures(engine, setup.prompt(config.full_prompt_tokens, 0), config.decode_tokens)


PARTS: dict[Part, Callable[[Setup, Progress], Figures]] = {
    Part.DENSE: run_dense,
    Part.TIERS: run_tiers,
    Part.RESTART: run_restart,
    Part.FULL_DENSE: lambda setup, say: run_full(setup, say, 0),
    Part.FULL_BLOCKWISE: lambda setup, say: run_full(setup, say, setup.config.attention_block_tokens),
}
