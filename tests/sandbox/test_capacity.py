"""What a server tells a fleet and how it sheds load: `GET /v1/load`, a bounded run queue answered
503 + Retry-After, instance-named session ids, and warm spares so a burst never waits on a worker start."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tether.errors import ConfigError
from tether.sandbox import NoFreeSlot, PoolConfig, RunStatus, SandboxPool, SandboxSpec
from tether.sandbox.server import create_app

SLEEP = {"code": "import time; time.sleep(1.5)"}


async def test_load_reports_slots_runs_queue_sessions_and_warm_workers() -> None:
    config = PoolConfig(slots=2, warm_target=1, instance_name="sandbox-7", max_queued=5)
    async with SandboxPool(SandboxSpec(timeout_s=10), config) as pool:
        await pool.warmed()
        transport = httpx.ASGITransport(app=create_app(pool))
        async with httpx.AsyncClient(transport=transport, base_url="http://sandbox") as http:
            idle = (await http.get("/v1/load")).json()
            session = (await http.post("/v1/sessions")).json()["id"]
            running = asyncio.create_task(http.post("/v1/run", json=SLEEP))
            while pool.busy_slots < 2:
                await asyncio.sleep(0.02)
            queued = asyncio.create_task(http.post("/v1/run", json={"code": "print(1)"}))
            while pool.queue_depth < 1:
                await asyncio.sleep(0.02)
            busy = (await http.get("/v1/load")).json()
            await asyncio.gather(running, queued)
            await http.delete(f"/v1/sessions/{session}")
    assert idle == {
        "instance": "sandbox-7",
        "slots": 2,
        "busy": 0,
        "queue_depth": 0,
        "max_queued": 5,
        "open_sessions": 0,
        "warm": 3,
    }
    assert session.startswith("sandbox-7~s")
    assert busy["busy"] == 2 and busy["queue_depth"] == 1 and busy["open_sessions"] == 1
    assert busy["warm"] == 1  # the spare: both slots' workers are in use


async def test_runs_beyond_the_bounded_queue_are_refused_with_503_and_retry_after() -> None:
    config = PoolConfig(slots=1, max_queued=1)
    async with SandboxPool(SandboxSpec(timeout_s=10), config) as pool:
        transport = httpx.ASGITransport(app=create_app(pool))
        async with httpx.AsyncClient(transport=transport, base_url="http://sandbox") as http:
            running = asyncio.create_task(http.post("/v1/run", json=SLEEP))
            while pool.busy_slots < 1:
                await asyncio.sleep(0.02)
            queued = asyncio.create_task(http.post("/v1/run", json={"code": "print('queued')"}))
            while pool.queue_depth < 1:
                await asyncio.sleep(0.02)
            refused = await http.post("/v1/run", json={"code": "print('refused')"})
            done = await asyncio.gather(running, queued)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["type"] == "no_free_slot" and "max_queued=1" in error["message"]
    assert [r.json()["status"] for r in done] == ["ok", "ok"]
    assert done[1].json()["stdout"] == "queued\n"


async def test_an_unbounded_local_pool_queues_every_run() -> None:
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1)) as pool:
        results = await asyncio.gather(*(pool.run(f"print({n})") for n in range(4)))
    assert [r.stdout for r in results] == [f"{n}\n" for n in range(4)]


async def test_the_bounded_queue_refuses_a_run_of_the_pool_itself_by_name() -> None:
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1, max_queued=0)) as pool:
        running = asyncio.create_task(pool.run("import time; time.sleep(1)"))
        while pool.busy_slots < 1:
            await asyncio.sleep(0.02)
        with pytest.raises(NoFreeSlot, match="max_queued=0") as refused:
            await pool.run("print(1)")
        assert refused.value.retry_after_s == 1
        assert (await running).status is RunStatus.OK


async def burst(pool: SandboxPool, size: int) -> None:
    results = await asyncio.gather(*(pool.run(f"print({n})") for n in range(size)))
    assert all(r.status is RunStatus.OK for r in results)


@pytest.mark.parametrize(("warm_target", "cold"), [(2, False), (0, True)])
async def test_warm_spares_let_a_burst_right_after_another_start_without_waiting_on_workers(
    warm_target: int, cold: bool
) -> None:
    # Every run discards its worker (max_runs_per_worker=1), the worst case for a following burst.
    config = PoolConfig(slots=2, warm_target=warm_target, max_runs_per_worker=1)
    async with SandboxPool(SandboxSpec(timeout_s=10), config) as pool:
        await pool.warmed()  # the spares of the pool's start, before the bursts that use them up
        await burst(pool, 2)
        await burst(pool, 2)  # right after: its slots' workers were discarded a moment ago
        cold_starts = pool.cold_starts
        while pool.warm_workers < 2 + warm_target:  # the spares refill in the background
            await asyncio.sleep(0.05)
    assert (cold_starts > 0) is cold, cold_starts
    assert pool.worker_starts == 4


@pytest.mark.parametrize(
    ("options", "phrase"),
    [
        ({"warm_target": -1}, "warm_target = -1"),
        ({"max_queued": -1}, "max_queued = -1"),
        ({"instance_name": "a/b"}, "instance_name = 'a/b'"),
        ({"instance_name": "x" * 129}, "instance_name = 'xxx"),
    ],
)
def test_bad_capacity_settings_are_refused_by_name(options: dict[str, object], phrase: str) -> None:
    with pytest.raises(ConfigError, match=phrase):
        PoolConfig(**options)  # type: ignore[arg-type]
