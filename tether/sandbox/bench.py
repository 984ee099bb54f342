"""Throughput benchmark: the warm pool against a fresh `python3` per run, in the same isolation.

Both modes run in the same process on the same snippet as a closed loop: `concurrency` clients each
submit their next run as soon as the last returns. A fresh run forks the same worker and execs a new
interpreter inside the same namespaces, cgroups and seccomp filter, so the ratio isolates the cost
of starting an interpreter. The modes alternate in rounds, so a machine that slows down or speeds up
during the benchmark weighs on both alike: figures on a shared machine are noisy, the ratio less so.
Beside the figures: the machine (CPU, vector extensions, cores, the workers it ran, the load average
before and after) and a warning for each load average that says other work shared the cores.
"""

from __future__ import annotations

import asyncio
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tether.machine import available_cores, load_average, machine_record
from tether.sandbox.pool import SandboxPool
from tether.sandbox.result import RunStatus

SNIPPET = "print(sum(range(1000)))"
EXPECTED_STDOUT = "499500\n"


class BenchmarkFailed(RuntimeError):
    """A benchmark run did not produce the expected output: the figures would mean nothing."""


@dataclass(slots=True)
class Phase:
    """Accumulated runs of one mode across rounds."""

    latencies_ms: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def exec_per_s(self) -> float:
        return len(self.latencies_ms) / self.elapsed_s

    def summary(self, prefix: str) -> dict[str, float | int]:
        return {
            f"{prefix}_runs": len(self.latencies_ms),
            f"{prefix}_exec_per_s": round(self.exec_per_s, 1),
            f"{prefix}_p50_ms": round(statistics.median(self.latencies_ms), 3),
            f"{prefix}_p99_ms": round(percentile(self.latencies_ms, 0.99), 3),
        }


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


async def run_phase(
    pool: SandboxPool,
    runs: int,
    concurrency: int,
    warm: bool,
    phase: Phase,
    on_run: Callable[[], None] | None = None,
) -> None:
    remaining = runs

    async def client() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            result = await pool.run(SNIPPET, language="python", warm=warm)
            phase.latencies_ms.append((time.perf_counter() - started) * 1000)
            if result.status is not RunStatus.OK or result.stdout != EXPECTED_STDOUT:
                raise BenchmarkFailed(f"run returned {result.status}: {result.stdout!r} {result.stderr!r}")
            if on_run is not None:
                on_run()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    phase.elapsed_s += time.perf_counter() - started


async def run_benchmark(
    pool: SandboxPool,
    pool_runs: int,
    fresh_runs: int,
    rounds: int = 10,
    warmup_runs: int = 20,
    on_run: Callable[[], None] | None = None,
) -> dict[str, object]:
    load_start = load_average()
    concurrency = pool.config.slots
    await run_phase(pool, warmup_runs, concurrency, warm=True, phase=Phase())
    warm, fresh = Phase(), Phase()
    for round_index in range(rounds):
        share = slice(round_index, None, rounds)
        await run_phase(pool, len(range(pool_runs)[share]), concurrency, True, warm, on_run)
        await run_phase(pool, len(range(fresh_runs)[share]), concurrency, False, fresh, on_run)
    return {
        "snippet": SNIPPET,
        **warm.summary("pool"),
        **fresh.summary("fresh"),
        "speedup": round(warm.exec_per_s / fresh.exec_per_s, 2),
        "rounds": rounds,
        "slots": pool.config.slots,
        "cpus": available_cores(),
        "python": platform.python_version(),
        "isolation": "user+pid+net+mount+ipc+uts namespaces, per-run cgroups, seccomp, read-only root",
        "machine": machine_record(pool.config.slots, load_start),
    }
