"""Peak smoothing: at most `max_in_flight` requests reach a pool at once; the rest wait in a bounded
queue, highest priority (the fast tier) first and in arrival order within a priority, each up to a
deadline. A full queue or a missed deadline is a refusal the caller turns into 503 + Retry-After.

`AdmissionQueue` counts in this process; `redis_admission.RedisAdmission` counts across gateway instances
(`shared_admission` in the config). Both are an `Admission`."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Protocol

from tether.errors import TetherError

if TYPE_CHECKING:
    from tether.gateway.config import GatewayConfig


class AdmissionRefused(TetherError):
    """The pool is saturated: the queue is full, or the wait passed its deadline (or, with shared
    admission, the store that counts the slots is unreachable)."""

    def __init__(self, message: str, retry_after_s: float, code: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after_s, self.code = retry_after_s, code


class Admission(Protocol):
    """One pool's admission: `acquire` a slot (or raise `AdmissionRefused`), `release` it when done."""

    name: str
    max_in_flight: int

    @property
    def in_flight(self) -> int:
        """Slots this instance holds."""

    @property
    def depth(self) -> int:
        """Requests waiting in this instance."""

    async def acquire(self, priority: int) -> None: ...

    def release(self) -> None: ...

    async def aclose(self) -> None: ...


def open_admissions(config: GatewayConfig) -> dict[str, Admission]:
    """Each pool's admission, shared through Redis when `shared_admission` is set. Nothing connects until
    first used; the Redis client is imported only when configured."""
    shared = config.shared_admission
    if shared is None:
        return {
            name: AdmissionQueue(name, pool.max_in_flight, pool.max_queued, pool.queue_deadline_s)
            for name, pool in config.pools.items()
        }
    from tether.gateway.redis_admission import RedisAdmission

    return {name: RedisAdmission(name, pool, shared) for name, pool in config.pools.items()}


class AdmissionQueue:
    def __init__(self, name: str, max_in_flight: int, max_queued: int, deadline_s: float) -> None:
        assert max_in_flight >= 1 and max_queued >= 0 and deadline_s > 0
        self.name = name
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.deadline_s = deadline_s
        self.in_flight = 0
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def depth(self) -> int:
        return sum(not future.done() for _, _, future in self._waiting)

    @asynccontextmanager
    async def slot(self, priority: int) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()

    async def acquire(self, priority: int) -> None:
        if self.in_flight < self.max_in_flight and not self.depth:
            self.in_flight += 1
            return
        if self.depth >= self.max_queued:
            raise AdmissionRefused(
                f"pool {self.name!r} is saturated: {self.in_flight} requests running and "
                f"{self.depth} queued (max_queued {self.max_queued}); retry later",
                1.0,
            )
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (-priority, next(self._order), future))
        try:
            await asyncio.wait_for(future, self.deadline_s)
        except TimeoutError:
            raise AdmissionRefused(
                f"pool {self.name!r} is saturated: waited {self.deadline_s:g} s (queue_deadline_s) "
                "without a free slot; retry later",
                self.deadline_s,
            ) from None
        except BaseException:
            if future.done() and not future.cancelled():  # the slot was handed over as we were cancelled
                self.release()
            raise

    def release(self) -> None:
        """Hand the slot to the first live waiter, or free it."""
        while self._waiting:
            _, _, future = heapq.heappop(self._waiting)
            if not future.done():
                future.set_result(None)
                return
        self.in_flight -= 1
        assert self.in_flight >= 0

    async def aclose(self) -> None:
        """Nothing to close: the count lives in this process."""
