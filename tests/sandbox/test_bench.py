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


async def test_a_small_run_records_the_machine_beside_its_figures() -> None:
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=2)) as pool:
        result = await run_benchmark(pool, pool_runs=10, fresh_runs=10, rounds=2, warmup_runs=2)
    machine = result["machine"]
    assert isinstance(machine, dict) and machine_record(1, 0.0).keys() <= machine.keys()
    assert machine["threads"] == 2 and result["pool_runs"] == 10
