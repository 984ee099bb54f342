"""The fair queue: bounded slots, FIFO within a client, round-robin between clients."""

from __future__ import annotations

import asyncio

import pytest

from tether.sandbox.fair_queue import FairQueue


async def test_slots_bound_concurrency() -> None:
    queue = FairQueue(2)
    active = peak = 0

    async def job() -> None:
        nonlocal active, peak
        async with queue.slot():
            active += 1
            peak = max(peak, active)
            await asyncio.sleep(0.01)
            active -= 1

    await asyncio.gather(*(job() for _ in range(10)))
    assert peak == 2
    assert queue.free_slots == 2


async def test_waiting_clients_are_served_round_robin() -> None:
    queue = FairQueue(1)
    await queue.acquire("holder")
    order: list[str] = []

    async def job(client: str, index: int) -> None:
        await queue.acquire(client)
        order.append(f"{client}{index}")
        queue.release()

    tasks = [asyncio.create_task(job("a", i)) for i in range(4)]
    tasks += [asyncio.create_task(job("b", i)) for i in range(2)]
    await asyncio.sleep(0)
    assert queue.depth == 6
    queue.release()
    await asyncio.gather(*tasks)
    assert order == ["a0", "b0", "a1", "b1", "a2", "a3"]


async def test_cancelled_waiter_does_not_leak_a_slot() -> None:
    queue = FairQueue(1)
    await queue.acquire()
    waiter = asyncio.create_task(queue.acquire("x"))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert queue.depth == 0
    queue.release()
    assert queue.free_slots == 1


def test_zero_slots_is_an_error() -> None:
    with pytest.raises(ValueError, match="slots must be at least 1, got 0"):
        FairQueue(0)


async def test_slots_not_free_at_first_open_one_by_one_as_they_are_released() -> None:
    queue = FairQueue(2, free=0)
    waiting = [asyncio.ensure_future(queue.acquire(client)) for client in ("a", "b")]
    await asyncio.sleep(0)
    assert not any(task.done() for task in waiting) and queue.depth == 2
    queue.release()  # the first slot's worker is up
    await asyncio.sleep(0)
    assert [task.done() for task in waiting] == [True, False]
    queue.release()
    await asyncio.gather(*waiting)
    assert queue.free_slots == 0 and queue.depth == 0


@pytest.mark.parametrize("free", [-1, 3])
def test_a_free_count_outside_the_slots_is_refused_by_name(free: int) -> None:
    with pytest.raises(ValueError, match=f"free must be between 0 and slots=2, got {free}"):
        FairQueue(2, free=free)
