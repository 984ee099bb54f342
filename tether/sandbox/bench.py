"""Throughput benchmark: the warm pool against a fresh `python3` per run, in the same isolation.

Both phases run in the same process on the same snippet as a closed loop: `concurrency` clients each
submit their next run as soon as the last returns. A fresh run forks the same worker and execs a new
interpreter inside the same namespaces, cgroups and seccomp filter, so the ratio isolates the cost
of starting an interpreter. Figures on a shared machine are noisy: report the ratio, not the times.
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from tether.sandbox.pool import SandboxPool
from tether.sandbox.result import RunStatus

SNIPPET = "print(sum(range(1000)))"
EXPECTED_STDOUT = "499500\n"


class BenchmarkFailed(RuntimeError):
    """A benchmark run did not produce the expected output: the figures would mean nothing."""


@dataclass(frozen=True, slots=True)
class PhaseResult:
    runs: int
    exec_per_s: float
    p50_ms: float
    p99_ms: float


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


async def run_phase(
    pool: SandboxPool, runs: int, concurrency: int, warm: bool, on_run: Callable[[], None] | None = None
) -> PhaseResult:
    latencies: list[float] = []
    remaining = runs

    async def client() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            result = await pool.run(SNIPPET, language="python", warm=warm)
            latencies.append((time.perf_counter() - started) * 1000)
            if result.status is not RunStatus.OK or result.stdout != EXPECTED_STDOUT:
                raise BenchmarkFailed(f"run returned {result.status}: {result.stdout!r} {result.stderr!r}")
            if on_run is not None:
                on_run()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return PhaseResult(
        len(latencies), len(latencies) / elapsed, statistics.median(latencies), percentile(latencies, 0.99)
    )


async def run_benchmark(
    pool: SandboxPool,
    pool_runs: int,
    fresh_runs: int,
    warmup_runs: int = 20,
    on_run: Callable[[], None] | None = None,
) -> dict[str, object]:
    concurrency = pool.config.slots
    await run_phase(pool, warmup_runs, concurrency, warm=True)
    warm = await run_phase(pool, pool_runs, concurrency, warm=True, on_run=on_run)
    fresh = await run_phase(pool, fresh_runs, concurrency, warm=False, on_run=on_run)
    return {
        "snippet": SNIPPET,
        "pool_runs": warm.runs,
        "pool_exec_per_s": round(warm.exec_per_s, 1),
        "pool_p50_ms": round(warm.p50_ms, 3),
        "pool_p99_ms": round(warm.p99_ms, 3),
        "fresh_runs": fresh.runs,
        "fresh_exec_per_s": round(fresh.exec_per_s, 1),
        "fresh_p50_ms": round(fresh.p50_ms, 3),
        "fresh_p99_ms": round(fresh.p99_ms, 3),
        "speedup": round(warm.exec_per_s / fresh.exec_per_s, 2),
        "slots": pool.config.slots,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "isolation": "user+pid+net+mount+ipc+uts namespaces, per-run cgroups, seccomp, read-only root",
    }
