"""The throughput acceptance figures (slow: run with `make bench`, outside the default suite), and a
small run that proves the result's shape in the default suite."""

from __future__ import annotations

import os

import pytest

from tether.machine import machine_record
from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec
from tether.sandbox.bench import run_benchmark


@pytest.mark.slow
async def test_warm_pool_beats_a_fresh_interpreter_fivefold() -> None:
    slots = 2 * (os.cpu_count() or 1)
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=slots)) as pool:
        result = await run_benchmark(pool, pool_runs=1500, fresh_runs=300)
    assert result["speedup"] >= 5, result
    assert result["pool_exec_per_s"] >= 250, result


async def test_the_bench_reports_the_acceptance_keys_and_the_machine_at_tiny_sizes() -> None:
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=2)) as pool:
        result = await run_benchmark(pool, pool_runs=20, fresh_runs=10, rounds=2, warmup_runs=4)
    assert result["pool_runs"] == 20 and result["fresh_runs"] == 10
    exec_per_s, p50, p99 = (
        float(str(result[key])) for key in ("pool_exec_per_s", "pool_p50_ms", "pool_p99_ms")
    )
    assert 0 < p50 <= p99 < 10_000
    # Two clients whose every run took at most p99 (the slowest of 20): at least 2000 / p99 runs/s,
    # less the time between runs, which half of that leaves room for.
    assert exec_per_s >= 1000 / p99
    machine = result["machine"]
    assert isinstance(machine, dict) and machine["threads"] == 2 and machine["cores"] >= 1
    assert isinstance(machine["vector_extensions"], list) and machine["cpu"]
    assert machine["load_average_start"] >= 0 and machine["load_average_end"] >= 0
    assert machine_record(1, 0.0).keys() <= machine.keys()
    assert isinstance(machine["busy_warnings"], list)
