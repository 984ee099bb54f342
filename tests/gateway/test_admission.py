"""The bounded admission queue: slots, fast tier first, deadlines, a full queue, cancelled waiters."""

from __future__ import annotations

import asyncio

import pytest

from tether.gateway.admission import AdmissionQueue, AdmissionRefused


async def test_waiters_get_slots_by_priority_then_arrival() -> None:
    queue = AdmissionQueue("p", max_in_flight=1, max_queued=10, deadline_s=5)
    await queue.acquire(0)
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        await queue.acquire(priority)
        order.append(name)
        queue.release()

    tasks = [asyncio.create_task(wait(name, p)) for name, p in [("s1", 0), ("s2", 0), ("f1", 10), ("f2", 10)]]
    await asyncio.sleep(0.01)
    assert queue.depth == 4
    queue.release()
    await asyncio.gather(*tasks)
    assert order == ["f1", "f2", "s1", "s2"]
    assert queue.in_flight == 0


async def test_a_full_queue_refuses_at_once() -> None:
    queue = AdmissionQueue("p", max_in_flight=1, max_queued=1, deadline_s=5)
    await queue.acquire(0)
    waiter = asyncio.create_task(queue.acquire(0))
    await asyncio.sleep(0)
    with pytest.raises(AdmissionRefused, match="max_queued 1") as refused:
        await queue.acquire(10)
    assert refused.value.retry_after_s > 0
    queue.release()
    await waiter
    queue.release()
    assert queue.in_flight == 0


async def test_a_waiter_past_its_deadline_is_refused() -> None:
    queue = AdmissionQueue("p", max_in_flight=1, max_queued=5, deadline_s=0.05)
    await queue.acquire(0)
    with pytest.raises(AdmissionRefused, match="queue_deadline_s"):
        await queue.acquire(0)
    assert queue.depth == 0
    queue.release()
    assert queue.in_flight == 0


async def test_cancelled_waiters_leak_no_slot() -> None:
    queue = AdmissionQueue("p", max_in_flight=1, max_queued=5, deadline_s=5)
    await queue.acquire(0)
    waiter = asyncio.create_task(queue.acquire(0))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.sleep(0)
    queue.release()
    assert queue.in_flight == 0
    async with queue.slot(0):
        assert queue.in_flight == 1
    assert queue.in_flight == 0
