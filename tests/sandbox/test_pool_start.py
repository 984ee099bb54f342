"""The pool's start: workers start in parallel, the first run needs only the first of them, a worker
that cannot start here fails the start itself, and worker processes launched ahead are taken."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from tether.sandbox import PoolConfig, RunStatus, SandboxPool, SandboxSpec
from tether.sandbox.launch import Launch, launch
from tether.sandbox.pool import SandboxUnavailable
from tether.sandbox.worker import Worker, WorkerError

SLOW_START_S = 3.0


@pytest.fixture
def slow_but_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker but the first takes SLOW_START_S longer to start."""
    start = Worker.start

    async def slow_start(self: Worker, timeout_s: float = 30.0, launched: Launch | None = None) -> None:
        if self.name != "w0":
            await asyncio.sleep(SLOW_START_S)
        await start(self, timeout_s, launched)

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
    async def broken(self: Worker, timeout_s: float = 30.0, launched: Launch | None = None) -> None:
        raise WorkerError(f"worker {self.name} exited while starting")

    monkeypatch.setattr(Worker, "start", broken)
    pool = SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=2))
    with pytest.raises(SandboxUnavailable, match="exited while starting"):
        await pool.start()
    assert pool.warm_workers == 0
    await pool.close()


async def test_the_pool_takes_the_worker_processes_launched_ahead_of_it() -> None:
    launches = [launch(sys.executable) for _ in range(2)]
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=2), launches=launches) as pool:
        await pool.warmed()
        started = {worker.process.pid for worker in pool._workers if worker.process is not None}
        assert started == {launched.popen.pid for launched in launches}
        results = await asyncio.gather(*(pool.run("print(1)") for _ in range(4)))
    assert all(r.status is RunStatus.OK and r.stdout == "1\n" for r in results)
    assert all(launched.popen.returncode is not None for launched in launches), "stopped with the pool"


async def test_launches_the_pool_cannot_use_are_killed_once_it_has_started() -> None:
    spare, foreign = launch(sys.executable), launch(sys.executable)
    foreign.python_executable = "/opt/another/python3"  # launched for a pool of another interpreter
    pool = SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1), launches=[spare, foreign])
    async with pool:
        (worker,) = pool._workers
        assert worker.process is not None and worker.process.pid == spare.popen.pid
        assert foreign.popen.poll() is not None
        assert (await pool.run("print(1)")).status is RunStatus.OK


async def test_a_failed_start_kills_the_launches_it_did_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tether.sandbox.pool.system_layout", lambda: None)  # as if no cgroups here
    launched = launch(sys.executable)
    with pytest.raises(SandboxUnavailable):
        await SandboxPool(SandboxSpec(), PoolConfig(slots=1), launches=[launched]).start()
    assert launched.popen.poll() is not None
