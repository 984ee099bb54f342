"""The int8 projection micro-benchmark: float32 (what a float model runs: oneDNN with packed weights, or
F.linear where it cannot pack), the old int8 path (F.linear on the dequantized weight) and the int8
kernel, per projection shape and row count, medians of interleaved repeats.

`streamed` cycles through enough copies of each weight that they come from memory, not the cache, as a
whole model's weights do during decoding (SmolLM2-135M: 424 MB in float32); hot runs the same weight.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from tether.kernels import cpu, int8_gemm
from tether.models import prepack
from tether.models.quantized_linear import quantize_weight

# SmolLM2-135M's decode projections as the engine calls them: q, k and v stacked, gate and up stacked.
SMOLLM2_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}

# Bytes of float32 weights a streamed run cycles through: more than any L3 cache of this project's CPUs.
STREAMED_BYTES = 256 << 20


@dataclass(frozen=True)
class MatmulTiming:
    shape: str
    rows: int
    streamed: bool
    float_us: float
    old_int8_us: float
    int8_us: float

    @property
    def speedup(self) -> float:
        return self.float_us / self.int8_us

    @property
    def old_speedup(self) -> float:
        return self.float_us / self.old_int8_us

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "int8_speedup": self.speedup, "old_int8_speedup": self.old_speedup}


def _median_us(calls: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median microseconds of each call, the calls interleaved so that load bursts hit them alike."""
    for call in calls:
        call()
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, times in zip(calls, samples, strict=True):
            started = time.perf_counter()
            call()
            times.append((time.perf_counter() - started) * 1e6)
    return [statistics.median(times) for times in samples]


def _cycling(items: list[torch.Tensor] | list[int8_gemm.PackedInt8]) -> Callable[[], int]:
    """An index into `items` that moves on at each call (so each call reads another copy)."""
    state = {"next": 0}

    def advance() -> int:
        state["next"] = (state["next"] + 1) % len(items)
        return state["next"]

    return advance


def time_shape(
    name: str,
    outputs: int,
    inputs: int,
    rows: int,
    repeats: int,
    streamed: bool,
    streamed_bytes: int = STREAMED_BYTES,
) -> MatmulTiming:
    """Median microseconds of a projection of `rows` rows in float32, in the old int8 path and the kernel."""
    copies = max(1, streamed_bytes // (4 * outputs * inputs)) if streamed else 1
    generator = torch.Generator().manual_seed(outputs * inputs)
    weights = [torch.randn(outputs, inputs, generator=generator) * 0.02 for _ in range(copies)]
    quantized = [quantize_weight(w) for w in weights]
    packs_float = prepack.supports(weights[0])
    floats = [prepack.pack(w) if packs_float else w for w in weights]
    packed = [int8_gemm.pack(q, s) for q, s in quantized]
    x = torch.randn(rows, inputs, generator=generator)
    index = _cycling(floats)

    def float_call() -> torch.Tensor:
        w = floats[index()]
        return prepack.linear(x, w, None) if packs_float else F.linear(x, w)

    def old_call() -> torch.Tensor:
        q, s = quantized[index()]
        return F.linear(x, q.to(x.dtype)) * s

    def int8_call() -> torch.Tensor:
        return int8_gemm.linear(x, packed[index()])

    with torch.inference_mode():
        float_us, old_us, int8_us = _median_us([float_call, old_call, int8_call], repeats)
    return MatmulTiming(name, rows, streamed, float_us, old_us, int8_us)


def run_matmul_bench(
    shapes: dict[str, tuple[int, int]],
    rows: Sequence[int],
    repeats: int,
    streamed: Sequence[bool],
    streamed_bytes: int = STREAMED_BYTES,
) -> dict[str, object]:
    """Every shape x row count x (hot, streamed), with the machine's state next to the figures."""
    timings = [
        time_shape(name, outputs, inputs, count, repeats, stream, streamed_bytes)
        for stream in streamed
        for name, (outputs, inputs) in shapes.items()
        for count in rows
    ]
    return {
        "cpu_model": cpu.cpu_model(),
        "int8_kernel": int8_gemm.int8_kernel(cpu.detected()).name,
        "features": sorted(feature.value for feature in cpu.detected()),
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "timings": [timing.as_dict() for timing in timings],
    }
