"""Admission shared through Redis by several instances: together they never exceed a pool's max_in_flight
and clients that give up leave nothing behind, a fast-tier waiter on one instance goes before a standard
one waiting longer on another, a holder killed with SIGKILL frees its slot after its lease, a release wakes
another instance's waiter at once (measured), and an unreachable Redis is a clear refusal, or the local
limit when configured so."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.live_server import free_port
from tether.gateway.admission import AdmissionRefused
from tether.gateway.config import Pool, SharedAdmission, StoreDown
from tether.gateway.redis_admission import RedisAdmission

from .conftest import REDIS_URL, skip_without_services
from .test_admission import delete_keys, until

pytestmark = pytest.mark.services


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    skip_without_services()
    prefix = f"test:{uuid.uuid4().hex}:"
    yield prefix
    await delete_keys(prefix)


def pool(max_in_flight: int = 1, max_queued: int = 64, deadline_s: float = 10.0) -> Pool:
    return Pool(
        urls=["http://engine:1"],
        max_in_flight=max_in_flight,
        max_queued=max_queued,
        queue_deadline_s=deadline_s,
    )


async def competing_heads(queue: RedisAdmission) -> int:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        return int(await client.zcard(queue.heads_key))
    finally:
        await client.aclose()


async def test_three_instances_never_exceed_the_pool_together(prefix: str) -> None:
    shared = SharedAdmission(url=REDIS_URL, prefix=prefix)
    instances = [RedisAdmission("p", pool(max_in_flight=4), shared) for _ in range(3)]
    running, peak, served = 0, 0, 0

    async def request(queue: RedisAdmission) -> None:
        nonlocal running, peak, served
        await queue.acquire(random.choice([0, 10]))
        try:
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(random.uniform(0, 0.01))
            running -= 1
            served += 1
        finally:
            queue.release()

    try:
        await asyncio.gather(*(request(instances[i % 3]) for i in range(150)))
        assert served == 150
        assert peak == 4  # reached, never passed
        assert all(queue.in_flight == 0 and queue.depth == 0 for queue in instances)
    finally:
        for queue in instances:
            await queue.aclose()


async def test_cancelled_and_timed_out_waiters_leave_no_slot_or_place_in_redis(prefix: str) -> None:
    shared = SharedAdmission(url=REDIS_URL, prefix=prefix)
    instances = [RedisAdmission("p", pool(max_in_flight=3, deadline_s=0.2), shared) for _ in range(3)]
    outcomes: list[str] = []

    async def request(queue: RedisAdmission) -> None:
        try:  # clients that give up at random moments, waiting or not
            await asyncio.wait_for(queue.acquire(random.choice([0, 10])), random.uniform(0, 0.3))
        except TimeoutError:
            outcomes.append("cancelled")
            return
        except AdmissionRefused:
            outcomes.append("refused")
            return
        try:
            await asyncio.sleep(random.uniform(0, 0.02))
            outcomes.append("served")
        finally:
            queue.release()

    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await asyncio.gather(*(request(instances[i % 3]) for i in range(150)))
        assert {"served", "cancelled"} <= set(outcomes) and len(outcomes) == 150
        deadline = time.monotonic() + 5
        while await client.zcard(instances[0].holders_key) or await client.zcard(instances[0].heads_key):
            assert time.monotonic() < deadline, "slots or places were left in Redis"
            await asyncio.sleep(0.01)
        for _ in range(3):  # every slot is free again
            await asyncio.wait_for(instances[0].acquire(0), 1)
        assert all(queue.in_flight == 0 for queue in instances[1:]) and instances[0].in_flight == 3
    finally:
        await client.aclose()
        for queue in instances:
            await queue.aclose()


async def test_a_fast_waiter_elsewhere_goes_before_a_standard_one_waiting_longer(prefix: str) -> None:
    shared = SharedAdmission(url=REDIS_URL, prefix=prefix)
    a, b = RedisAdmission("p", pool(), shared), RedisAdmission("p", pool(), shared)
    try:
        await a.acquire(0)
        standard = asyncio.create_task(a.acquire(0))
        await until(lambda: a.depth == 1)
        assert await competing_heads(a) == 1
        fast = asyncio.create_task(b.acquire(10))
        await until(lambda: b.depth == 1)
        assert await competing_heads(a) == 2
        a.release()
        await asyncio.wait_for(fast, 2)
        await asyncio.sleep(0.3)  # a's waiter is woken by the release too, and polls: it must stay out
        assert not standard.done() and a.in_flight == 0 and b.in_flight == 1
        b.release()
        await asyncio.wait_for(standard, 2)
        a.release()
    finally:
        await a.aclose()
        await b.aclose()


HOLDER = """
import asyncio, sys
from tether.gateway.config import Pool, SharedAdmission
from tether.gateway.redis_admission import RedisAdmission

async def main() -> None:
    shared = SharedAdmission(url=sys.argv[1], prefix=sys.argv[2], lease_s=1.0, poll_s=0.1)
    queue = RedisAdmission("p", Pool(urls=["http://engine:1"], max_in_flight=1), shared)
    await queue.acquire(0)
    print("held", flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


async def test_a_holder_killed_with_sigkill_frees_its_slot_after_its_lease(prefix: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, REDIS_URL, prefix], stdout=subprocess.PIPE, env=env
    )
    queue = RedisAdmission(
        "p", pool(), SharedAdmission(url=REDIS_URL, prefix=prefix, lease_s=1.0, poll_s=0.1)
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
        assert line == b"held\n"
        waiter = asyncio.create_task(queue.acquire(0))
        await asyncio.sleep(2.0)  # twice the lease: the live holder renews it
        assert not waiter.done()
        child.kill()
        child.wait()
        killed = time.monotonic()
        await asyncio.wait_for(waiter, 5)
        freed_after_s = time.monotonic() - killed
        print(f"slot freed {freed_after_s:.2f} s after the SIGKILL (lease_s 1)")
        # the slot outlives its holder by what was left of its last renewal (renewed every 1/3 s) plus a poll
        assert 0.3 < freed_after_s < 1.0 + 0.1 + 0.3
        queue.release()
    finally:
        child.kill()
        child.wait()
        await queue.aclose()


async def test_a_release_wakes_another_instances_waiter_at_once(prefix: str) -> None:
    # polls are 1 s apart here, so a waiter admitted well within that was woken by the release notice
    shared = SharedAdmission(url=REDIS_URL, prefix=prefix, lease_s=10.0, poll_s=1.0)
    a, b = RedisAdmission("p", pool(), shared), RedisAdmission("p", pool(), shared)
    latencies = []
    try:
        for _ in range(20):
            await a.acquire(0)
            waiter = asyncio.create_task(b.acquire(0))
            await until(lambda: b.depth == 1)
            while await competing_heads(b) != 1:  # b has tried once and waits
                await asyncio.sleep(0.005)
            released = time.monotonic()
            a.release()
            await asyncio.wait_for(waiter, 2)
            latencies.append(time.monotonic() - released)
            b.release()
            await until(lambda: b.in_flight == 0)
            while await competing_heads(b):
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.01)  # b's release has reached Redis
    finally:
        await a.aclose()
        await b.aclose()
    print(
        f"release to admission elsewhere: median {statistics.median(latencies) * 1000:.1f} ms, "
        f"max {max(latencies) * 1000:.1f} ms"
    )
    assert max(latencies) < 0.25


async def test_an_unreachable_store_refuses_naming_it() -> None:
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"
    queue = RedisAdmission("p", pool(), SharedAdmission(url=url))
    try:
        for _ in range(2):  # the first try finds it down, the second is refused without trying
            with pytest.raises(AdmissionRefused, match="unreachable") as refused:
                await queue.acquire(0)
            assert refused.value.code == "admission_store_unavailable" and refused.value.retry_after_s >= 1
            message = str(refused.value)
            assert "127.0.0.1" in message and "secret" not in message and "on_store_down" in message
        assert queue.in_flight == 0 and queue.depth == 0
    finally:
        await queue.aclose()


async def test_an_unreachable_store_can_fall_back_to_the_local_limit() -> None:
    shared = SharedAdmission(url=f"redis://127.0.0.1:{free_port()}/0", on_store_down=StoreDown.LOCAL)
    queue = RedisAdmission("p", pool(max_in_flight=2, deadline_s=0.2), shared)
    try:
        await queue.acquire(0)
        await queue.acquire(0)
        assert queue.in_flight == 2
        with pytest.raises(AdmissionRefused, match="queue_deadline_s"):  # the local limit holds
            await queue.acquire(0)
        queue.release()
        queue.release()
        assert queue.in_flight == 0
    finally:
        await queue.aclose()


async def test_a_head_left_by_a_dead_instance_blocks_others_for_at_most_its_lease(prefix: str) -> None:
    queue = RedisAdmission(
        "p", pool(), SharedAdmission(url=REDIS_URL, prefix=prefix, lease_s=1.0, poll_s=0.1)
    )
    client = aioredis.Redis.from_url(REDIS_URL)
    try:  # a fast-tier waiter of an instance that died: registered once, never renewed nor withdrawn
        seconds, micros = await client.time()
        await client.zadd(queue.heads_key, {"0:dead:0": -10})
        await client.zadd(queue.heads_key + ":expiry", {"0:dead:0": seconds * 1000 + micros // 1000 + 1000})
        started = time.monotonic()
        await asyncio.wait_for(queue.acquire(0), 5)
        assert 0.7 < time.monotonic() - started < 1.0 + 0.1 + 0.3
        queue.release()
    finally:
        await client.aclose()
        await queue.aclose()
