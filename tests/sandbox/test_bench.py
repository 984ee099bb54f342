"""The throughput acceptance figures (slow: run with `make bench`, outside the default suite)."""

from __future__ import annotations

import os

import pytest

from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec
from tether.sandbox.bench import run_benchmark


@pytest.mark.slow
async def test_warm_pool_beats_a_fresh_interpreter_fivefold() -> None:
    slots = 2 * (os.cpu_count() or 1)
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=slots)) as pool:
        result = await run_benchmark(pool, pool_runs=1500, fresh_runs=300)
    assert result["speedup"] >= 5, result
    assert result["pool_exec_per_s"] >= 250, result
