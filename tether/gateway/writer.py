"""Write-behind for the ledger: charges queue up and one task commits them in batches (group commit,
lingering `linger_s` for company), so a response never waits for the database and concurrent requests
share one transaction.

Limits stay safe meanwhile: a request's reservation is settled to its actual usage only after its
ledger row is committed, so until then it holds at least as much as it used. A charge whose batch keeps
failing is logged in full at ERROR (for reconciliation) and its reservation is never released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict

from tether.gateway.ledger import Charge, Ledger

logger = logging.getLogger(__name__)

AfterCommit = Callable[[], Awaitable[None]]


class LedgerWriter:
    def __init__(
        self,
        ledger: Ledger,
        max_batch: int = 256,
        linger_s: float = 0.02,
        attempts: int = 3,
        backoff_s: float = 0.5,
        on_failure: Callable[[int], None] = lambda _: None,
    ) -> None:
        self.ledger = ledger
        self.max_batch = max_batch
        self.linger_s = linger_s
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.on_failure = on_failure
        self._queue: asyncio.Queue[tuple[Charge, AfterCommit]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def submit(self, charge: Charge, after_commit: AfterCommit) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="tether-ledger-writer")
        self._queue.put_nowait((charge, after_commit))

    async def flush(self) -> None:
        """Wait until everything submitted so far is committed (or given up on)."""
        await self._queue.join()

    async def close(self) -> None:
        if self._task is not None:
            await self.flush()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            # wait a moment for company: one commit per batch costs far less CPU than one per request
            await asyncio.sleep(self.linger_s)
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                if await self._commit([charge for charge, _ in batch]):
                    for _, after in batch:
                        try:
                            await after()
                        except Exception:
                            logger.exception("settling after a ledger commit failed")
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _commit(self, charges: list[Charge]) -> bool:
        for attempt in range(1, self.attempts + 1):
            try:
                await asyncio.to_thread(self.ledger.record, charges)
                return True
            except Exception:
                logger.exception(
                    "ledger write of %d charges failed (attempt %d/%d)", len(charges), attempt, self.attempts
                )
                if attempt < self.attempts:
                    await asyncio.sleep(self.backoff_s * attempt)
        for charge in charges:
            logger.error("unrecorded charge: %s", {**asdict(charge), "tier": charge.tier.value})
        self.on_failure(len(charges))
        return False
