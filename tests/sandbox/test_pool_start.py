"""The pool's start: workers start in parallel, the first run needs only the first of them, and a
worker that cannot start here fails the start itself."""

from __future__ import annotations

import asyncio
import time

import pytest

from tether.sandbox import PoolConfig, RunStatus, SandboxPool, SandboxSpec
from tether.sandbox.pool import SandboxUnavailable
from tether.sandbox.worker import Worker, WorkerError

SLOW_START_S = 3.0


@pytest.fixture
def slow_but_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker but the first takes SLOW_START_S longer to start."""
    start = Worker.start

    async def slow_start(self: Worker, timeout_s: float = 30.0) -> None:
        if self.name != "w0":
            await asyncio.sleep(SLOW_START_S)
        await start(self, timeout_s)

    monkeypatch.setattr(Worker, "start", slow_start)


@pytest.mark.usefixtures("slow_but_first")
async def test_the_first_run_completes_before_the_slow_workers_are_up() -> None:
    began = time.monotonic()
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=3)) as pool:
        result = await pool.run("print(1)")
        first_run_s = time.monotonic() - began
        assert result.status is RunStatus.OK and result.stdout == "1\n"
        assert first_run_s < SLOW_START_S, first_run_s
        assert pool.warm_workers == 1 and pool.busy_slots == 0  # warming slots are not busy ones
        await pool.warmed()
        assert pool.warm_workers == 3
        both = await asyncio.gather(*(pool.run("import time; time.sleep(0.3)") for _ in range(3)))
    assert all(r.status is RunStatus.OK for r in both)
    # In parallel: three workers, two of them slow, were all up in about one slow start.
    assert time.monotonic() - began < 2 * SLOW_START_S


@pytest.mark.usefixtures("slow_but_first")
async def test_runs_beyond_the_first_worker_wait_for_the_warming_slots_instead_of_being_refused() -> None:
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=2, max_queued=0)) as pool:
        results = await asyncio.gather(*(pool.run("import time; time.sleep(0.5)") for _ in range(2)))
    assert all(r.status is RunStatus.OK for r in results)


async def test_a_worker_that_cannot_start_fails_the_pool_start(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(self: Worker, timeout_s: float = 30.0) -> None:
        raise WorkerError(f"worker {self.name} exited while starting")

    monkeypatch.setattr(Worker, "start", broken)
    pool = SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=2))
    with pytest.raises(SandboxUnavailable, match="exited while starting"):
        await pool.start()
    assert pool.warm_workers == 0
    await pool.close()
