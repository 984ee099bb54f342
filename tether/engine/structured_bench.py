"""The structured-output benchmark: random JSON schemas (`tether.testing.schemas`) decoded under their
`json_schema` grammar, checked with `jsonschema`, and timed against the same prompts unconstrained.

A first constrained pass over all schemas at once gives the validity figure (a document that is cut off
by `max_tokens`, does not parse or does not validate counts as invalid) and each prompt's output length.
Each repeat then runs every group of `group` prompts constrained and unconstrained back to back (EOS
ignored, each prompt to its constrained length, so both decode the same token counts in the same batch
shapes), in alternating order; `constrained_overhead` is the median of the pairs' time-per-token ratios.
Short adjacent pairs see the same load on a shared machine, which one long pass each would not; an
untimed pass before each pair puts the group's prompts in the prefix cache for both. Decoding is greedy.
The benchmark measures; it prints nothing.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema

from tether.engine.bench_machine import bench_threads, machine_info
from tether.engine.llm_engine import Completion, LLMEngine
from tether.engine.sampling import SamplingParams
from tether.engine.sequence import FinishReason
from tether.engine.structured import StructuredOutput
from tether.errors import ConfigError
from tether.machine import load_average
from tether.models.loader import resolve
from tether.testing.schemas import random_schema

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Progress = Callable[[str], None]
INSTRUCTION = "Reply with one JSON object that follows this JSON schema, and nothing else:\n"


@dataclass(frozen=True, slots=True)
class StructuredBenchConfig:
    model: str = "smollm2-135m-instruct"
    """A registered model name or a Hugging Face folder."""
    cache_dir: Path | None = None
    schemas: int = 50
    """Random schemas, one request each, all in flight at once."""
    max_tokens: int = 512
    """Output budget of each request: a document longer than this is invalid."""
    repeats: int = 3
    """Timed rounds over all groups; the overhead is the median over every group of every round."""
    group: int = 10
    """Prompts decoded together in one timed pair (constrained, unconstrained)."""
    seed: int = 0
    """Seed of the schemas."""
    kv_cache_mib: int = 256
    threads: int | None = None
    """Torch threads; None: the cores idle at the start (`configure_threads`)."""

    def __post_init__(self) -> None:
        for name in ("schemas", "max_tokens", "repeats", "group", "kv_cache_mib", "threads"):
            value = getattr(self, name)
            if value is None and name == "threads":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"structured bench: {name} = {value!r}: expected an integer of at least 1")


def schema_prompt(tokenizer: PreTrainedTokenizerBase, schema: dict[str, Any]) -> list[int]:
    messages = [{"role": "user", "content": INSTRUCTION + json.dumps(schema)}]
    text = str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    return list(tokenizer.encode(text, add_special_tokens=False))


def is_valid(completion: Completion, schema: dict[str, Any]) -> bool:
    """Complete (stopped, not cut off), parses as JSON and validates against `schema`."""
    if completion.finish_reason is not FinishReason.STOP:
        return False
    try:
        jsonschema.validate(json.loads(completion.text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def run_pass(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[float, list[Completion]]:
    """All requests at once through continuous batching; (seconds, first completion of each)."""
    started = time.perf_counter()
    for i, (prompt, each) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"structured-{i}", prompt, each)
    done: dict[str, Completion] = {}
    while engine.has_unfinished():
        done.update((o.request_id, o.completions[0]) for o in engine.step() if o.finished)
    seconds = time.perf_counter() - started
    return seconds, [done[f"structured-{i}"] for i in range(len(prompts))]


def run_structured_bench(config: StructuredBenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Validity and overhead figures as one flat JSON-ready dict."""
    say = progress or (lambda _message: None)
    started = time.perf_counter()
    load_start = load_average()
    threads = bench_threads(config.threads)
    say("loading the model")
    engine, tokenizer = LLMEngine.from_pretrained(
        resolve(config.model, config.cache_dir), kv_cache_mib=config.kv_cache_mib, seed=config.seed
    )
    rng = random.Random(config.seed)
    schemas = [random_schema(rng) for _ in range(config.schemas)]
    prompts = [schema_prompt(tokenizer, schema) for schema in schemas]
    constrained = [
        SamplingParams(
            max_tokens=config.max_tokens,
            temperature=0,
            structured=StructuredOutput("json_schema", json.dumps(schema)),
        )
        for schema in schemas
    ]
    say(f"validity: {config.schemas} schemas, constrained")
    _, first = run_pass(engine, prompts, constrained)
    valid = [is_valid(completion, schema) for completion, schema in zip(first, schemas, strict=True)]
    lengths = [len(completion.token_ids) for completion in first]
    free = [SamplingParams(max_tokens=length, temperature=0, ignore_eos=True) for length in lengths]
    tokens = sum(lengths)
    passes = {"constrained": constrained, "unconstrained": free}
    totals = dict.fromkeys(passes, 0.0)
    ratios: list[float] = []
    starts = range(0, len(prompts), config.group)
    groups = [list(range(start, min(start + config.group, len(prompts)))) for start in starts]
    for repeat in range(config.repeats):
        say(f"timing: repeat {repeat + 1} of {config.repeats}")
        for number, group in enumerate(groups):
            # Both timed passes then find the group's prompts in the prefix cache (all of them do not fit):
            # otherwise the first would prefill them and the second not, and the pair would time that.
            run_pass(engine, [prompts[i] for i in group], [SamplingParams(max_tokens=1)] * len(group))
            seconds = {}
            for name in sorted(passes, reverse=(repeat + number) % 2 == 1):  # alternate which goes first
                params = passes[name]
                elapsed, completions = run_pass(
                    engine, [prompts[i] for i in group], [params[i] for i in group]
                )
                assert [len(c.token_ids) for c in completions] == [lengths[i] for i in group], (
                    "greedy repeats"
                )
                seconds[name] = elapsed
                totals[name] += elapsed
            ratios.append(seconds["constrained"] / seconds["unconstrained"])
    return {
        "model": config.model,
        "schemas": config.schemas,
        "schema_valid_fraction": sum(valid) / len(valid),
        "invalid_schemas": [i for i, ok in enumerate(valid) if not ok],
        "output_tokens": tokens,
        "max_tokens": config.max_tokens,
        "constrained_ms_per_token": 1000 * totals["constrained"] / (tokens * config.repeats),
        "unconstrained_ms_per_token": 1000 * totals["unconstrained"] / (tokens * config.repeats),
        "constrained_overhead": statistics.median(ratios),
        "overhead_quartiles": statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3,
        "overhead_of_totals": totals["constrained"] / totals["unconstrained"],
        "repeats": config.repeats,
        "group": config.group,
        "threads": threads,
        "machine": machine_info(threads, load_start),
        "seconds": time.perf_counter() - started,
    }
