"""The sliding-window accounting core, with the same tests run against the in-process store and the Redis
Lua store (real Redis), on a fake clock."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from tether.gateway.config import Limits
from tether.gateway.limits import Counter, LimitKind, LimitStore, MemoryLimitStore, counters_for
from tether.gateway.redis_limits import RedisLimitStore

from .conftest import REDIS_URL, skip_without_services

STORES = ["memory", pytest.param("redis", marks=pytest.mark.services)]


@pytest.fixture(params=STORES)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[LimitStore]:
    if request.param == "memory":
        yield MemoryLimitStore()
        return
    skip_without_services()
    redis_store = RedisLimitStore(REDIS_URL, prefix=f"test:{uuid.uuid4().hex}:")
    try:
        yield redis_store
    finally:
        await redis_store.delete_prefix()
        await redis_store.close()


def tokens(amount: int, limit: int = 100, window_s: float = 10.0, name: str = "key:k:tokens") -> Counter:
    return Counter(name, LimitKind.TOKENS, "key", limit, window_s, amount)


async def test_reservations_fill_the_window_then_refuse(store: LimitStore) -> None:
    assert await store.reserve("a", [tokens(60)], now=0.0) is None
    assert await store.reserve("b", [tokens(40)], now=1.0) is None
    refusal = await store.reserve("c", [tokens(1)], now=2.0)
    assert refusal is not None and refusal.used == 100 and refusal.counter.name == "key:k:tokens"
    assert refusal.retry_after_s == pytest.approx(8.0)  # "a" leaves the window at t = 10


async def test_entries_leave_the_window_as_it_slides(store: LimitStore) -> None:
    assert await store.reserve("a", [tokens(60)], now=0.0) is None
    assert await store.reserve("b", [tokens(40)], now=5.0) is None
    assert await store.reserve("c", [tokens(50)], now=9.9) is not None
    assert await store.reserve("c", [tokens(50)], now=10.0) is None
    assert await store.used(tokens(0), now=10.0) == 90
    assert await store.used(tokens(0), now=15.0) == 50


async def test_settling_to_the_actual_amount_frees_room(store: LimitStore) -> None:
    counter = tokens(100)
    assert await store.reserve("a", [counter], now=0.0) is None
    assert await store.reserve("b", [tokens(30)], now=1.0) is not None
    await store.settle("a", [counter], {counter.name: 70})
    assert await store.used(counter, now=1.0) == 70
    assert await store.reserve("b", [tokens(30)], now=1.0) is None


async def test_settling_an_expired_reservation_changes_nothing(store: LimitStore) -> None:
    counter = tokens(50)
    assert await store.reserve("a", [counter], now=0.0) is None
    assert await store.used(counter, now=20.0) == 0
    await store.settle("a", [counter], {counter.name: 10})
    assert await store.used(counter, now=20.0) == 0


async def test_a_refusal_by_one_counter_reserves_in_none(store: LimitStore) -> None:
    roomy = tokens(10, limit=1000, name="tenant:t:tokens")
    full = Counter("key:k:requests", LimitKind.REQUESTS, "key", 1, 60.0, 1)
    assert await store.reserve("a", [roomy, full], now=0.0) is None
    refusal = await store.reserve("b", [roomy, full], now=1.0)
    assert refusal is not None and refusal.counter.name == "key:k:requests"
    assert await store.used(roomy, now=1.0) == 10


async def test_an_amount_above_the_limit_can_never_fit(store: LimitStore) -> None:
    refusal = await store.reserve("a", [tokens(101)], now=0.0)
    assert refusal is not None and refusal.retry_after_s == float("inf")


async def test_concurrent_reservations_never_exceed_the_limit(store: LimitStore) -> None:
    results = await asyncio.gather(*(store.reserve(f"r{i}", [tokens(7)], now=0.0) for i in range(40)))
    admitted = sum(result is None for result in results)
    assert admitted == 100 // 7
    assert await store.used(tokens(0), now=0.0) == admitted * 7


@pytest.mark.parametrize(
    ("limits", "names"),
    [
        (Limits(), []),
        (Limits(requests_per_minute=5), ["key:k:requests"]),
        (Limits(tokens_per_window=9, budget_usd="1.5"), ["key:k:tokens", "key:k:spend"]),
    ],
)
def test_counters_follow_the_configured_limits(limits: Limits, names: list[str]) -> None:
    counters = counters_for(limits, "key", "k", tokens=3, spend_nano_usd=4)
    assert [c.name for c in counters] == names
    for counter in counters:
        expected = {LimitKind.REQUESTS: 1, LimitKind.TOKENS: 3, LimitKind.SPEND: 4}[counter.kind]
        assert counter.amount == expected
    spend = [c for c in counters if c.kind is LimitKind.SPEND]
    assert not spend or spend[0].limit == 1_500_000_000
