"""The bounded admission queue, in process and shared through Redis (one instance here; several in
test_redis_admission.py): slots, fast tier first, deadlines, a full queue, cancelled waiters."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from tether.gateway.admission import Admission, AdmissionQueue, AdmissionRefused
from tether.gateway.config import Pool, SharedAdmission
from tether.gateway.redis_admission import RedisAdmission

from .conftest import REDIS_URL, skip_without_services

MakeQueue = Callable[..., Admission]


async def delete_keys(prefix: str) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    async for key in client.scan_iter(match=prefix + "*"):
        await client.delete(key)
    await client.aclose()


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.services)])
async def make_queue(request: pytest.FixtureRequest) -> AsyncIterator[MakeQueue]:
    """Builds the queue under test: `AdmissionQueue`, or a `RedisAdmission` under a fresh key prefix."""
    made: list[Admission] = []
    prefix = f"test:{uuid.uuid4().hex}:"
    if request.param == "redis":
        skip_without_services()

    def make(max_in_flight: int, max_queued: int, deadline_s: float) -> Admission:
        queue: Admission
        if request.param == "local":
            queue = AdmissionQueue("p", max_in_flight, max_queued, deadline_s)
        else:
            pool = Pool(
                urls=["http://e:1"],
                max_in_flight=max_in_flight,
                max_queued=max_queued,
                queue_deadline_s=deadline_s,
            )
            queue = RedisAdmission("p", pool, SharedAdmission(url=REDIS_URL, prefix=prefix))
        made.append(queue)
        return queue

    yield make
    for queue in made:
        await queue.aclose()
    await delete_keys(prefix)


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true"
        await asyncio.sleep(0.005)


async def test_waiters_get_slots_by_priority_then_arrival(make_queue: MakeQueue) -> None:
    queue = make_queue(max_in_flight=1, max_queued=10, deadline_s=5)
    await queue.acquire(0)
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        await queue.acquire(priority)
        order.append(name)
        queue.release()

    tasks = []
    for name, priority in [("s1", 0), ("s2", 0), ("f1", 10), ("f2", 10)]:
        tasks.append(asyncio.create_task(wait(name, priority)))
        await until(lambda: queue.depth == len(tasks))
    queue.release()
    await asyncio.gather(*tasks)
    assert order == ["f1", "f2", "s1", "s2"]
    assert queue.in_flight == 0


async def test_a_full_queue_refuses_at_once(make_queue: MakeQueue) -> None:
    queue = make_queue(max_in_flight=1, max_queued=1, deadline_s=5)
    await queue.acquire(0)
    waiter = asyncio.create_task(queue.acquire(0))
    await until(lambda: queue.depth == 1)
    with pytest.raises(AdmissionRefused, match="max_queued 1") as refused:
        await queue.acquire(10)
    assert refused.value.retry_after_s > 0 and refused.value.code == "queue_full"
    queue.release()
    await waiter
    queue.release()
    assert queue.in_flight == 0


async def test_no_queue_admits_only_into_a_free_slot(make_queue: MakeQueue) -> None:
    queue = make_queue(max_in_flight=1, max_queued=0, deadline_s=5)
    await queue.acquire(0)
    with pytest.raises(AdmissionRefused, match="max_queued 0"):
        await queue.acquire(0)
    queue.release()
    deadline = time.monotonic() + 2  # a shared slot is back once Redis has the release
    while True:
        try:
            await queue.acquire(0)
            break
        except AdmissionRefused:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
    assert queue.in_flight == 1


async def test_a_waiter_past_its_deadline_is_refused(make_queue: MakeQueue) -> None:
    queue = make_queue(max_in_flight=1, max_queued=5, deadline_s=0.05)
    await queue.acquire(0)
    with pytest.raises(AdmissionRefused, match="queue_deadline_s") as refused:
        await queue.acquire(0)
    assert refused.value.retry_after_s > 0
    assert queue.depth == 0
    queue.release()
    assert queue.in_flight == 0


async def test_cancelled_waiters_leak_no_slot(make_queue: MakeQueue) -> None:
    queue = make_queue(max_in_flight=1, max_queued=5, deadline_s=5)
    await queue.acquire(0)
    waiter = asyncio.create_task(queue.acquire(0))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.sleep(0)
    queue.release()
    assert queue.in_flight == 0
    await asyncio.wait_for(queue.acquire(0), 2)
    assert queue.in_flight == 1
    queue.release()
    assert queue.in_flight == 0
