"""End-to-end decode throughput of int8 weights against float32: the same model loaded both ways, the
same greedy workload at each stream count, float and int8 interleaved in every repeat, medians reported
with the machine's load next to them (`bench_machine`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tether.engine.bench import Workload, run_engine
from tether.engine.bench_machine import bench_threads, machine_info
from tether.engine.llm_engine import LLMEngine
from tether.machine import busy_warnings, load_average

# A fixed prompt per stream: short, so the decode steps (where weights dominate) fill the time.
PROMPT_TOKENS = 16


def workload(streams: int, new_tokens: int) -> Workload:
    prompts = [[(7 * stream + 13 * i) % 500 + 10 for i in range(PROMPT_TOKENS)] for stream in range(streams)]
    return Workload(prompts, [new_tokens] * streams)


def measure_int8_throughput(
    model: str | Path,
    streams: Sequence[int],
    new_tokens: int,
    repeats: int,
    threads: int | None = None,
    kv_cache_mib: int = 64,
) -> dict[str, Any]:
    """Tokens/s of float32 and int8 engines per stream count, and int8's ratio over float."""
    chosen = bench_threads(threads)
    load_start = load_average()
    engines = {
        name: LLMEngine.from_pretrained(model, kv_cache_mib=kv_cache_mib, quantization=method)[0]
        for name, method in (("float32", None), ("int8", "int8"))
    }
    results: dict[str, Any] = {}
    for count in streams:
        work = workload(count, new_tokens)
        for engine in engines.values():
            run_engine(engine, workload(count, 2))  # warm: packed copies built, first-call costs paid
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(repeats):
            for name, engine in engines.items():
                seconds[name].append(run_engine(engine, work)[0])
        rates = {name: work.output_tokens / statistics.median(times) for name, times in seconds.items()}
        results[f"float32_tok_s_{count}"] = rates["float32"]
        results[f"int8_tok_s_{count}"] = rates["int8"]
        results[f"int8_speedup_{count}"] = rates["int8"] / rates["float32"]
    load_end = load_average()
    return {
        **results,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "machine": machine_info(chosen, load_start),
        "warnings": busy_warnings(chosen, {"at the start": load_start, "at the end": load_end}),
    }
