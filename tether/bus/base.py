"""The task bus contract: at-least-once delivery of task ids with acks and a visibility timeout.

A received message stays invisible to other consumers for `visibility_timeout_s`; if its consumer
neither acks nor extends it in that time (it crashed or stalled), the message is delivered again to
someone. Consumers pull at most as many messages as they have free slots, so overload waits in the
queue instead of being dropped. The bus carries task ids only; the journal holds everything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tether.errors import ConfigError


@dataclass(frozen=True, slots=True)
class BusConfig:
    url: str  # sqlite:///PATH, redis://HOST:PORT[/DB] or nats://HOST:PORT
    name: str = "tether-tasks"  # the queue / stream / consumer-group namespace
    visibility_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.name or not all(ch.isalnum() or ch in "-_" for ch in self.name):
            raise ConfigError(f"bus name {self.name!r}: use letters, digits, '-' and '_' only")
        if not self.visibility_timeout_s > 0:
            raise ConfigError(f"visibility_timeout_s = {self.visibility_timeout_s}: must be > 0 seconds")


@dataclass(frozen=True, slots=True)
class Delivery:
    task_id: str
    message_id: str
    attempt: int  # 1 on first delivery; more when redelivered after a consumer failed to ack
    receipt: object = None  # back-end handle needed to ack or extend this delivery


class TaskBus(Protocol):
    config: BusConfig

    async def publish(self, task_id: str) -> str:
        """Enqueue a task id durably; returns the message id."""
        ...

    async def receive(self, max_messages: int, wait_s: float) -> list[Delivery]:
        """Up to `max_messages` visible messages, waiting at most `wait_s` for the first."""
        ...

    async def ack(self, delivery: Delivery) -> None:
        """Remove the message for good; acking twice is harmless."""
        ...

    async def extend(self, delivery: Delivery) -> None:
        """Restart the visibility timeout: the consumer is still working on it."""
        ...

    async def depth(self) -> int:
        """Messages not yet acknowledged (queued or in flight)."""
        ...

    async def close(self) -> None: ...

    async def destroy(self) -> None:
        """Delete the queue and everything in it (tests clean up their unique queues with this)."""
        ...
