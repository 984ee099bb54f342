"""A fair admission queue for a fixed number of slots: waiting clients are served round-robin.

One client submitting a thousand runs cannot starve another that submits one: each free slot goes to
the next client in rotation, and within a client runs keep their submission order.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class FairQueue:
    def __init__(self, slots: int, free: int | None = None) -> None:
        """`free`: the slots free at first (default: all); the others are freed by `release` as they
        come up (a pool's slots whose workers are still starting)."""
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        if free is not None and not 0 <= free <= slots:
            raise ValueError(f"free must be between 0 and slots={slots}, got {free}")
        self._free = slots if free is None else free
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    @property
    def depth(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    @property
    def free_slots(self) -> int:
        return self._free

    @asynccontextmanager
    async def slot(self, client: str = "") -> AsyncIterator[None]:
        await self.acquire(client)
        try:
            yield
        finally:
            self.release()

    async def acquire(self, client: str = "") -> None:
        if self._free > 0 and not self._waiting:
            self._free -= 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(client, deque()).append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()
            else:
                self._forget(client, future)
            raise

    def release(self) -> None:
        while self._waiting:
            client, queue = next(iter(self._waiting.items()))
            future = queue.popleft()
            if queue:
                self._waiting.move_to_end(client)
            else:
                del self._waiting[client]
            if not future.done():
                future.set_result(None)
                return
        self._free += 1

    def _forget(self, client: str, future: asyncio.Future[None]) -> None:
        queue = self._waiting.get(client)
        if queue and future in queue:
            queue.remove(future)
            if not queue:
                del self._waiting[client]
