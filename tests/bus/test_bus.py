"""Every bus back end against one contract, on real servers: acks, redelivery, extension, backpressure."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from tests.store.backends import skip_without_services
from tether.bus import BusConfig, TaskBus, open_bus
from tether.errors import ConfigError

TIMEOUT_S = 1.0
URLS: dict[str, Callable[[Path], str]] = {
    "sqlite": lambda tmp: f"sqlite:///{tmp / 'bus.db'}",
    "redis": lambda _: "redis://127.0.0.1:6379/0",
    "nats": lambda _: "nats://127.0.0.1:4222",
}
BACKENDS = [
    "sqlite",
    pytest.param("redis", marks=pytest.mark.services),
    pytest.param("nats", marks=pytest.mark.services),
]

BusFactory = Callable[[], TaskBus]


@pytest_asyncio.fixture(params=BACKENDS)
async def make_bus(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BusFactory]:
    """Opens consumers of one fresh, uniquely named queue; deletes the queue afterwards."""
    if request.param != "sqlite":
        skip_without_services()
    config = BusConfig(
        URLS[request.param](tmp_path), name=f"t-{uuid.uuid4().hex[:10]}", visibility_timeout_s=TIMEOUT_S
    )
    opened: list[TaskBus] = []

    def factory() -> TaskBus:
        opened.append(open_bus(config))
        return opened[-1]

    yield factory
    await opened[0].destroy()
    for bus in opened:
        await bus.close()


async def test_a_message_is_delivered_once_and_gone_after_ack(make_bus: BusFactory) -> None:
    bus = make_bus()
    await bus.publish("task-a")
    (delivery,) = await bus.receive(10, wait_s=2)
    assert delivery.task_id == "task-a" and delivery.attempt == 1
    await bus.ack(delivery)
    await bus.ack(delivery)  # harmless twice
    await asyncio.sleep(TIMEOUT_S + 0.3)
    assert await bus.receive(10, wait_s=0.2) == []
    assert await bus.depth() == 0


async def test_an_unacked_message_is_redelivered_after_the_visibility_timeout(make_bus: BusFactory) -> None:
    crashed, survivor = make_bus(), make_bus()
    await crashed.publish("task-a")
    (first,) = await crashed.receive(1, wait_s=2)
    assert await survivor.receive(1, wait_s=0.3) == []  # invisible while the first consumer holds it
    await asyncio.sleep(TIMEOUT_S + 0.3)
    (again,) = await survivor.receive(1, wait_s=2)
    assert again.task_id == "task-a" and again.message_id == first.message_id
    assert again.attempt == 2
    await survivor.ack(again)
    assert await survivor.depth() == 0


async def test_extending_keeps_a_message_invisible_past_the_timeout(make_bus: BusFactory) -> None:
    holder, other = make_bus(), make_bus()
    await holder.publish("task-a")
    (delivery,) = await holder.receive(1, wait_s=2)
    for _ in range(4):
        await asyncio.sleep(TIMEOUT_S / 2)
        await holder.extend(delivery)
    assert await other.receive(1, wait_s=0.2) == []
    await holder.ack(delivery)


async def test_overload_queues_instead_of_dropping(make_bus: BusFactory) -> None:
    bus = make_bus()
    for index in range(7):
        await bus.publish(f"task-{index}")
    taken = await bus.receive(3, wait_s=2)
    assert len(taken) == 3
    assert await bus.receive(0, wait_s=0.1) == []
    assert await bus.depth() == 7
    seen = [delivery.task_id for delivery in taken]
    for delivery in taken:
        await bus.ack(delivery)
    while len(seen) < 7:
        batch = await bus.receive(3, wait_s=2)
        assert batch, "messages were lost"
        seen += [delivery.task_id for delivery in batch]
        for delivery in batch:
            await bus.ack(delivery)
    assert sorted(seen) == sorted(f"task-{index}" for index in range(7))


async def test_concurrent_consumers_never_share_a_delivery(make_bus: BusFactory) -> None:
    consumers = [make_bus() for _ in range(3)]
    for index in range(12):
        await consumers[0].publish(f"task-{index}")

    async def drain(bus: TaskBus) -> list[str]:
        got: list[str] = []
        while batch := await bus.receive(2, wait_s=0.5):
            got += [delivery.task_id for delivery in batch]
            for delivery in batch:
                await bus.ack(delivery)
        return got

    results = await asyncio.gather(*(drain(bus) for bus in consumers))
    everything = [task for got in results for task in got]
    assert sorted(everything) == sorted(f"task-{index}" for index in range(12))


@pytest.mark.parametrize(
    ("url", "name", "timeout_s", "message"),
    [
        ("amqp://x", "q", 1.0, "unknown scheme 'amqp'"),
        ("queue.db", "q", 1.0, "unknown scheme ''"),
        ("sqlite:///x.db", "bad name!", 1.0, "bus name 'bad name!'"),
        ("sqlite:///x.db", "q", 0.0, "visibility_timeout_s = 0.0"),
    ],
)
def test_bad_bus_configs_are_rejected(url: str, name: str, timeout_s: float, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        open_bus(BusConfig(url, name=name, visibility_timeout_s=timeout_s))
