"""Redis Streams bus: one stream and one consumer group; pending entries idle past the timeout are reclaimed.

A delivery is an entry in the group's pending list. `receive` first claims entries idle longer than the
visibility timeout (`XAUTOCLAIM`, the redelivery path), then reads new ones; `extend` re-claims an entry
for its own consumer, which resets its idle time; `ack` acknowledges and deletes the entry.
"""

from __future__ import annotations

import uuid
from typing import Any

import redis.asyncio as redis
from redis.exceptions import ResponseError

from tether.bus.base import BusConfig, Delivery
from tether.errors import ConfigError

_GROUP = "workers"


class RedisStreamsBus:
    def __init__(self, config: BusConfig, consumer: str | None = None) -> None:
        if not config.url.startswith(("redis://", "rediss://")):
            raise ConfigError(f"bus url {config.url!r}: the Redis Streams bus needs redis://HOST:PORT[/DB]")
        self.config = config
        self.stream = f"{config.name}:stream"
        self.consumer = consumer or f"c-{uuid.uuid4().hex[:12]}"
        self._redis: Any = redis.from_url(config.url, decode_responses=True)
        self._group_ready = False

    @property
    def _idle_ms(self) -> int:
        return int(self.config.visibility_timeout_s * 1000)

    async def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            await self._redis.xgroup_create(self.stream, _GROUP, id="0", mkstream=True)
        except ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self._group_ready = True

    async def publish(self, task_id: str) -> str:
        await self._ensure_group()
        return str(await self._redis.xadd(self.stream, {"task_id": task_id}))

    async def _attempts(self, message_id: str) -> int:
        pending = await self._redis.xpending_range(self.stream, _GROUP, message_id, message_id, 1)
        return int(pending[0]["times_delivered"]) if pending else 1

    async def receive(self, max_messages: int, wait_s: float) -> list[Delivery]:
        if max_messages < 1:
            return []
        await self._ensure_group()
        _, claimed, _ = await self._redis.xautoclaim(
            self.stream, _GROUP, self.consumer, self._idle_ms, "0-0", count=max_messages
        )
        deliveries = [
            Delivery(fields["task_id"], message_id, await self._attempts(message_id))
            for message_id, fields in claimed
            if fields  # an entry deleted while pending comes back without fields
        ]
        if deliveries:
            return deliveries
        block_ms = max(int(wait_s * 1000), 1)
        reply = await self._redis.xreadgroup(
            _GROUP, self.consumer, {self.stream: ">"}, count=max_messages, block=block_ms
        )
        for _, entries in reply or []:
            deliveries.extend(Delivery(fields["task_id"], message_id, 1) for message_id, fields in entries)
        return deliveries

    async def ack(self, delivery: Delivery) -> None:
        await self._redis.xack(self.stream, _GROUP, delivery.message_id)
        await self._redis.xdel(self.stream, delivery.message_id)

    async def extend(self, delivery: Delivery) -> None:
        await self._redis.xclaim(self.stream, _GROUP, self.consumer, 0, [delivery.message_id], justid=True)

    async def depth(self) -> int:
        await self._ensure_group()
        return int(await self._redis.xlen(self.stream))

    async def close(self) -> None:
        await self._redis.aclose()

    async def destroy(self) -> None:
        await self._redis.delete(self.stream)
