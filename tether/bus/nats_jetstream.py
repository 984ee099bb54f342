"""NATS JetStream bus: a work-queue stream and one durable pull consumer shared by every worker.

JetStream does the redelivery itself: a message not acked within the consumer's `ack_wait` (the
visibility timeout) is delivered again; `extend` sends a progress ack (`+WPI`), which restarts it.
`max_ack_pending` is unlimited here because each worker bounds what it pulls.
"""

from __future__ import annotations

import contextlib
from typing import Any

import nats
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StreamConfig
from nats.js.errors import NotFoundError

from tether.bus.base import BusConfig, Delivery
from tether.errors import ConfigError


class NatsJetStreamBus:
    def __init__(self, config: BusConfig) -> None:
        if not config.url.startswith(("nats://", "tls://")):
            raise ConfigError(f"bus url {config.url!r}: the JetStream bus needs nats://HOST:PORT")
        self.config = config
        self.stream = config.name.replace("-", "_")
        self.subject = f"{self.stream}.tasks"
        self._nc: Any = None
        self._js: Any = None
        self._sub: Any = None

    async def _connect(self) -> Any:
        if self._js is not None:
            return self._js
        self._nc = await nats.connect(self.config.url, connect_timeout=5, max_reconnect_attempts=3)
        self._js = self._nc.jetstream()
        try:
            await self._js.stream_info(self.stream)
        except NotFoundError:
            await self._js.add_stream(
                StreamConfig(name=self.stream, subjects=[self.subject], retention=RetentionPolicy.WORK_QUEUE)
            )
        return self._js

    async def _subscription(self) -> Any:
        if self._sub is None:
            js = await self._connect()
            self._sub = await js.pull_subscribe(
                self.subject,
                durable="workers",
                stream=self.stream,
                config=ConsumerConfig(
                    ack_policy=AckPolicy.EXPLICIT,
                    ack_wait=self.config.visibility_timeout_s,
                    max_deliver=-1,
                    max_ack_pending=-1,
                ),
            )
        return self._sub

    async def publish(self, task_id: str) -> str:
        js = await self._connect()
        ack = await js.publish(self.subject, task_id.encode())
        return str(ack.seq)

    async def receive(self, max_messages: int, wait_s: float) -> list[Delivery]:
        if max_messages < 1:
            return []
        sub = await self._subscription()
        try:
            messages = await sub.fetch(max_messages, timeout=max(wait_s, 0.05))
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        return [
            Delivery(
                message.data.decode(),
                str(message.metadata.sequence.stream),
                int(message.metadata.num_delivered),
                message,
            )
            for message in messages
        ]

    async def ack(self, delivery: Delivery) -> None:
        message: Any = delivery.receipt
        with contextlib.suppress(nats.errors.MsgAlreadyAckdError):
            await message.ack_sync()

    async def extend(self, delivery: Delivery) -> None:
        message: Any = delivery.receipt
        await message.in_progress()

    async def depth(self) -> int:
        js = await self._connect()
        info = await js.stream_info(self.stream)
        return int(info.state.messages)

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()
            self._nc = self._js = self._sub = None

    async def destroy(self) -> None:
        js = await self._connect()
        with contextlib.suppress(NotFoundError):
            await js.delete_stream(self.stream)
