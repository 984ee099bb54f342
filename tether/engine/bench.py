"""The engine benchmark: continuous batching, prefix cache, speculation and int8 weights against baselines.

Every figure is a median over `repeats`, and each baseline (transformers' static batches, a cold prefix
cache, plain decoding, float weights) runs in the same invocation, interleaved with what it is compared
to: absolute times on a shared machine mean little. Speculation is measured where prompt lookup is meant
to pay, on tasks whose output mostly copies the prompt (rewrite a snippet with one rename), each decoded
alone. The benchmark loads models and measures; it prints nothing.
"""

from __future__ import annotations

import difflib
import itertools
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from tether.engine.bench_machine import bench_threads, machine_info
from tether.engine.llm_engine import Completion, LLMEngine
from tether.engine.model_runner import Batch, ModelRunner, SequenceChunk
from tether.engine.sampling import SamplingParams
from tether.engine.speculative import SpeculativeConfig, SpeculativeMode, SpeculativeStats
from tether.errors import ConfigError
from tether.machine import load_average
from tether.models.loader import resolve
from tether.models.quantize import REFERENCE_TEXT, quantize_int8
from tether.models.transformer import CausalLM

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Progress = Callable[[str], None]

SYSTEM = "You are a helpful assistant. Answer clearly and in full sentences."
QUESTIONS = (
    "Explain how a {} works.",
    "Write a short story about a {}.",
    "What are the main advantages of a {}?",
    "Describe the history of the {} in a few paragraphs.",
)
TOPICS = (
    "bicycle",
    "lighthouse",
    "steam engine",
    "library",
    "volcano",
    "telescope",
    "garden",
    "bridge",
    "submarine",
    "violin",
    "windmill",
    "compass",
    "glacier",
    "printing press",
    "honeybee",
    "railway",
)

# The speculative-decoding task: output that mostly copies the prompt, where prompt lookup pays. The reply
# is started for the model (the fence and the renamed signature) and the snippets are ones SmolLM2-135M
# reproduces faithfully; `spec_copy_similarity` reports how much of each output is the expected code.
COPY_TASK = (
    "Rewrite the following Python code with the function renamed from `{old}` to `{new}`. "
    "Change nothing else and reply with the code only.\n\n```python\n{code}```"
)
COPY_REPLY_START = "```python\ndef {new}("
COPY_SNIPPETS = (
    (
        "binary_search",
        "find_index",
        "def binary_search(items, target):\n"
        "    low, high = 0, len(items) - 1\n"
        "    while low <= high:\n"
        "        middle = (low + high) // 2\n"
        "        if items[middle] == target:\n"
        "            return middle\n"
        "        if items[middle] < target:\n"
        "            low = middle + 1\n"
        "        else:\n"
        "            high = middle - 1\n"
        "    return -1\n",
    ),
    (
        "fibonacci",
        "fib_sequence",
        "def fibonacci(n):\n"
        "    sequence = [0, 1]\n"
        "    while len(sequence) < n:\n"
        "        sequence.append(sequence[-1] + sequence[-2])\n"
        "    return sequence[:n]\n",
    ),
    (
        "gcd",
        "greatest_common_divisor",
        "def gcd(a, b):\n    while b != 0:\n        a, b = b, a % b\n    return a\n",
    ),
    (
        "is_prime",
        "check_prime",
        "def is_prime(n):\n"
        "    if n < 2:\n"
        "        return False\n"
        "    for i in range(2, int(n ** 0.5) + 1):\n"
        "        if n % i == 0:\n"
        "            return False\n"
        "    return True\n",
    ),
)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    model: str | Path = "smollm2-135m-instruct"
    """A registered model name or a Hugging Face folder."""
    cache_dir: Path | None = None
    """Model cache root (default: the settings' cache_dir)."""
    requests: int = 64
    """Requests in the throughput workload (four static batches of the transformers baseline)."""
    min_output: int = 16
    """Shortest output, in tokens (lengths are drawn uniformly, seeded, and exact: EOS is ignored)."""
    max_output: int = 192
    """Longest output, in tokens: 192, not 256, so the run fits 10 minutes on a shared 2-core machine
    (transformers' static batches dominate it); 16-192 wastes as much on their padding as 16-256 (README)."""
    hf_batch_size: int = 16
    """Static batch size of the transformers baseline."""
    prefix_tokens: int = 1024
    """Shared prefix of the time-to-first-token measurement, in tokens."""
    repeats: int = 3
    """Repeats of every measurement; figures are medians."""
    kv_cache_mib: int = 768
    """KV cache of each engine, in MiB."""
    spec_tokens: int = 8
    """Draft tokens per step (k) of the n-gram speculation measurement."""
    spec_max_output: int = 256
    """Output cap of each copy task (they usually end at EOS sooner)."""
    lanes: int = 1
    """Data-parallel lanes of the engines (see `ModelRunner`); 1: each op split over the threads."""
    threads: int | None = None
    """Torch threads of every measurement; None: the cores idle at the start (`configure_threads`)."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "requests",
            "min_output",
            "max_output",
            "hf_batch_size",
            "prefix_tokens",
            "repeats",
            "spec_tokens",
            "spec_max_output",
            "lanes",
            "threads",
        ):
            value = getattr(self, name)
            if value is None and name == "threads":  # optional: None sizes to the idle cores
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"bench: {name} = {value!r}: expected an integer of at least 1")
        if self.max_output < self.min_output:
            raise ConfigError(
                f"bench: max_output = {self.max_output}: expected at least min_output ({self.min_output})"
            )
        if self.kv_cache_mib < 1:
            raise ConfigError(f"bench: kv_cache_mib = {self.kv_cache_mib}: expected at least 1")


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[int]]
    lengths: list[int]  # exact output tokens of each request

    @property
    def output_tokens(self) -> int:
        return sum(self.lengths)


@dataclass(slots=True)
class _Samples:
    """Per-repeat measurements, reduced to medians at the end."""

    engine_s: list[float] = field(default_factory=list)
    hf_s: list[float] = field(default_factory=list)
    int8_s: list[float] = field(default_factory=list)
    spec_s: list[float] = field(default_factory=list)
    plain_copy_s: list[float] = field(default_factory=list)
    cached_ttft_s: list[float] = field(default_factory=list)
    cold_ttft_s: list[float] = field(default_factory=list)


def make_workload(tokenizer: PreTrainedTokenizerBase, config: BenchConfig) -> Workload:
    rng = random.Random(config.seed)
    prompts: list[list[int]] = []
    for i in range(config.requests):
        question = QUESTIONS[i % len(QUESTIONS)].format(TOPICS[(i // len(QUESTIONS)) % len(TOPICS)])
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompts.append([int(t) for t in cast(list[int], ids)])
    lengths = [rng.randint(config.min_output, config.max_output) for _ in prompts]
    return Workload(prompts, lengths)


def copy_prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Chat prompts asking to reproduce a code snippet with one rename, the reply already started."""
    prompts = []
    for old, new, code in COPY_SNIPPETS:
        messages = [{"role": "user", "content": COPY_TASK.format(old=old, new=new, code=code)}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        start = tokenizer.encode(COPY_REPLY_START.format(new=new), add_special_tokens=False)
        prompts.append([int(t) for t in cast(list[int], ids)] + [int(t) for t in start])
    return prompts


def copy_similarity(texts: list[str]) -> float:
    """Mean similarity (difflib ratio) of each reply, with its started part, to the renamed snippet."""
    ratios = []
    for (old, new, code), text in zip(COPY_SNIPPETS, texts, strict=True):
        reply = COPY_REPLY_START.format(new=new) + text
        expected = "```python\n" + code.replace(old, new) + "```"
        ratios.append(difflib.SequenceMatcher(None, reply, expected).ratio())
    return statistics.fmean(ratios)


def run_one_by_one(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int
) -> tuple[float, list[Completion]]:
    """Seconds to decode each prompt alone (greedy, to EOS or max_tokens), and the outputs."""
    engine.block_manager.invalidate_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    outputs = []
    started = time.perf_counter()
    for prompt in prompts:
        [output] = engine.generate([prompt], params)
        outputs.append(output.completions[0])
    return time.perf_counter() - started, outputs


def prefix_prompts(tokenizer: PreTrainedTokenizerBase, prefix_tokens: int) -> tuple[list[int], list[int]]:
    """Two prompts sharing their first `prefix_tokens` tokens (the reference text, repeated)."""
    text_ids = [int(t) for t in tokenizer.encode(REFERENCE_TEXT, add_special_tokens=False)]
    prefix = list(itertools.islice(itertools.cycle(text_ids), prefix_tokens))
    first = [int(t) for t in tokenizer.encode(" What happened in the morning?", add_special_tokens=False)]
    second = [int(t) for t in tokenizer.encode(" What happened in the evening?", add_special_tokens=False)]
    return prefix + first, prefix + second


@torch.inference_mode()
def perplexity(model: CausalLM, token_ids: list[int], block_size: int = 16) -> float:
    """exp(mean negative log-likelihood) of every token after the first, in one prefill."""
    assert len(token_ids) >= 2, "perplexity needs at least two tokens"
    blocks = -(-len(token_ids) // block_size)
    runner = ModelRunner(model, num_blocks=blocks, block_size=block_size)
    batch = runner.make_batch([SequenceChunk(token_ids, 0, list(range(blocks)))])
    every = torch.arange(len(token_ids) - 1, device=runner.device)
    logits = runner.run(Batch(batch.input_ids, batch.positions, batch.attention, every))
    targets = torch.tensor(token_ids[1:], device=runner.device)
    return math.exp(float(F.cross_entropy(logits, targets)))


def run_engine(engine: LLMEngine, workload: Workload) -> tuple[float, list[list[int]]]:
    """Seconds to finish the whole workload through continuous batching (greedy), and the outputs."""
    engine.block_manager.invalidate_prefix_cache()  # no repeat profits from the one before
    base = f"bench-{time.monotonic_ns()}"
    outputs: dict[str, list[int]] = {}
    started = time.perf_counter()
    for i, (prompt, length) in enumerate(zip(workload.prompts, workload.lengths, strict=True)):
        params = SamplingParams(max_tokens=length, temperature=0, ignore_eos=True)
        engine.add_request(f"{base}-{i}", prompt, params)
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.completions[0].token_ids
    elapsed = time.perf_counter() - started
    return elapsed, [outputs[f"{base}-{i}"] for i in range(len(workload.prompts))]


@torch.inference_mode()
def run_hf(hf: Any, pad_id: int, workload: Workload, batch_size: int) -> tuple[float, list[list[int]]]:
    """Seconds for transformers `generate` in static, left-padded batches (each runs to its longest
    member), and each request's first `length` tokens."""
    outputs: list[list[int]] = []
    started = time.perf_counter()
    for start in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[start : start + batch_size]
        lengths = workload.lengths[start : start + batch_size]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        new = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(lengths),
            do_sample=False,
            pad_token_id=pad_id,
        )[:, width:]
        assert new.shape[1] == max(lengths), "transformers stopped early: EOS was not disabled"
        outputs.extend(
            [int(t) for t in row[:length]] for row, length in zip(new.tolist(), lengths, strict=True)
        )
    return time.perf_counter() - started, outputs


def time_to_first_token(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """Seconds until the first token of `prompt` (prefill included), and how many tokens came from cache."""
    started = time.perf_counter()
    [output] = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - started, output.num_cached_tokens


def load_reference(folder: Path) -> Any:
    """transformers' model for the same folder, in float32, never stopping at EOS."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # ignore_eos, as the engine requests do
    return hf


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.inf


def run_bench(config: BenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run every measurement; returns one flat JSON-ready dict of medians and the workload's shape."""
    say = progress or (lambda _message: None)
    started = time.perf_counter()
    load_start = load_average()
    threads = bench_threads(config.threads)
    folder = resolve(config.model, config.cache_dir)
    say("loading models")
    engine, tokenizer = LLMEngine.from_pretrained(folder, kv_cache_mib=config.kv_cache_mib, seed=config.seed)
    int8_engine, _ = LLMEngine.from_pretrained(folder, kv_cache_mib=config.kv_cache_mib, seed=config.seed)
    quantize_int8(int8_engine.runner.model)
    spec_engine, _ = LLMEngine.from_pretrained(
        folder,
        kv_cache_mib=config.kv_cache_mib,
        seed=config.seed,
        speculative=SpeculativeConfig(mode=SpeculativeMode.NGRAM, num_speculative_tokens=config.spec_tokens),
    )
    for each in (engine, int8_engine, spec_engine):
        each.runner.set_lanes(config.lanes)
    hf = load_reference(folder)
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    workload = make_workload(tokenizer, config)
    warmup = Workload(workload.prompts[:2], [4, 4])
    for warm in (engine, int8_engine):
        run_engine(warm, warmup)
    copies = copy_prompts(tokenizer)
    run_one_by_one(spec_engine, copies[:1], 8)
    run_hf(hf, pad_id, warmup, config.hf_batch_size)

    samples = _Samples()
    engine_outputs: list[list[int]] = []
    hf_outputs: list[list[int]] = []
    spec_outputs: list[Completion] = []
    plain_outputs: list[Completion] = []
    for repeat in range(config.repeats):
        say(f"repeat {repeat + 1}/{config.repeats}: engine, {workload.output_tokens} tokens")
        seconds, engine_outputs = run_engine(engine, workload)
        samples.engine_s.append(seconds)
        say(f"repeat {repeat + 1}/{config.repeats}: transformers, static batches of {config.hf_batch_size}")
        seconds, hf_outputs = run_hf(hf, pad_id, workload, config.hf_batch_size)
        samples.hf_s.append(seconds)
        say(f"repeat {repeat + 1}/{config.repeats}: engine with int8 weights")
        samples.int8_s.append(run_engine(int8_engine, workload)[0])
        say(f"repeat {repeat + 1}/{config.repeats}: copy tasks, plain decoding")
        seconds, plain_outputs = run_one_by_one(engine, copies, config.spec_max_output)
        samples.plain_copy_s.append(seconds)
        say(f"repeat {repeat + 1}/{config.repeats}: copy tasks, n-gram speculative decoding")
        spec_engine.spec_stats = SpeculativeStats()
        seconds, spec_outputs = run_one_by_one(spec_engine, copies, config.spec_max_output)
        samples.spec_s.append(seconds)

    first, second = prefix_prompts(tokenizer, config.prefix_tokens)
    cached_tokens = 0
    time_to_first_token(engine, first)  # warm-up at this length
    for repeat in range(config.repeats):
        say(f"repeat {repeat + 1}/{config.repeats}: time to first token, {config.prefix_tokens}-token prefix")
        engine.block_manager.invalidate_prefix_cache()
        time_to_first_token(engine, first)  # fills the prefix cache
        seconds, cached_tokens = time_to_first_token(engine, second)
        samples.cached_ttft_s.append(seconds)
        engine.block_manager.invalidate_prefix_cache()
        samples.cold_ttft_s.append(time_to_first_token(engine, second)[0])

    say("perplexity of float and int8 weights")
    text_ids = [int(t) for t in tokenizer.encode(REFERENCE_TEXT, add_special_tokens=False)]
    float_ppl = perplexity(engine.runner.model, text_ids)
    int8_ppl = perplexity(int8_engine.runner.model, text_ids)

    tokens = workload.output_tokens
    throughput = tokens / statistics.median(samples.engine_s)
    hf_throughput = tokens / statistics.median(samples.hf_s)
    int8_throughput = tokens / statistics.median(samples.int8_s)
    prefix_ttft = statistics.median(samples.cached_ttft_s)
    cold_ttft = statistics.median(samples.cold_ttft_s)
    matches = sum(ours == theirs for ours, theirs in zip(engine_outputs, hf_outputs, strict=True))
    copy_tokens = sum(len(completion.token_ids) for completion in plain_outputs)
    spec_matches = sum(
        ours.token_ids == theirs.token_ids for ours, theirs in zip(plain_outputs, spec_outputs, strict=True)
    )
    return {
        "model": str(config.model),
        "requests": config.requests,
        "output_tokens": tokens,
        "min_output": config.min_output,
        "max_output": config.max_output,
        "hf_batch_size": config.hf_batch_size,
        "repeats": config.repeats,
        "threads": threads,
        "lanes": config.lanes,
        "throughput_tok_s": throughput,
        "hf_throughput_tok_s": hf_throughput,
        "throughput_speedup": ratio(throughput, hf_throughput),
        "prefix_tokens": config.prefix_tokens,
        "prefix_cached_tokens": cached_tokens,
        "prefix_ttft_ms": 1000 * prefix_ttft,
        "cold_ttft_ms": 1000 * cold_ttft,
        "prefix_speedup": ratio(cold_ttft, prefix_ttft),
        "int8_throughput_tok_s": int8_throughput,
        "int8_speedup": ratio(int8_throughput, throughput),
        "float_ppl": float_ppl,
        "int8_ppl": int8_ppl,
        "int8_ppl_delta": int8_ppl - float_ppl,
        "greedy_match": matches / len(workload.prompts),
        "spec_tasks": len(copies),
        "spec_tokens": config.spec_tokens,
        "spec_output_tokens": copy_tokens,
        "spec_plain_tok_s": copy_tokens / statistics.median(samples.plain_copy_s),
        "spec_throughput_tok_s": copy_tokens / statistics.median(samples.spec_s),
        "spec_speedup": ratio(statistics.median(samples.plain_copy_s), statistics.median(samples.spec_s)),
        "acceptance_rate": spec_engine.spec_stats.acceptance_rate,
        "spec_greedy_match": spec_matches / len(copies),
        "spec_copy_similarity": copy_similarity([completion.text for completion in plain_outputs]),
        "duration_s": time.perf_counter() - started,
        "freed_memory_kept": engine.keeps_freed_memory,  # every run's allocator setting (`host_heap`)
        "machine": machine_info(threads, load_start),
    }
