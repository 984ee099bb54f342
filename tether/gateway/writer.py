"""Group commit for the ledger: reservations, charges and releases queue up, and one task commits whatever
has queued in one transaction while the requests behind them wait, so concurrent requests share a commit
but none is answered before its own write is durable.

The guarantee the gateway builds on: when `reserve` or `charge` returns True the row is committed (a
crash after that loses nothing), and a charge's reservation is settled in the limits right after its
commit. When a batch keeps failing they return False and every charge in it is logged in full at ERROR
(for reconciliation); the gateway then refuses the request instead of serving what it cannot bill.
Releases and refusals are not waited for: a release lost in a crash leaves a reservation counted at its
worst case, which errs on the safe side; a refusal lost in one is missing from the usage page only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from tether.gateway.ledger import Charge, Ledger, Reservation
from tether.gateway.usage_log import Refused

logger = logging.getLogger(__name__)

AfterCommit = Callable[[], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class _Write:
    """One queued write and what to do once it is committed."""

    done: asyncio.Future[bool]
    reserved: Reservation | None = None
    charge: Charge | None = None
    released: str | None = None
    refused: Refused | None = None
    after_commit: AfterCommit | None = None


class LedgerWriter:
    def __init__(
        self,
        ledger: Ledger,
        max_batch: int = 256,
        attempts: int = 3,
        backoff_s: float = 0.05,
        on_failure: Callable[[int], None] = lambda _: None,
    ) -> None:
        self.ledger = ledger
        self.max_batch = max_batch
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.on_failure = on_failure
        self._queue: asyncio.Queue[_Write] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def reserve(self, reservation: Reservation) -> asyncio.Future[bool]:
        """Resolves to True once the reservation is committed."""
        return self._submit(reserved=reservation)

    def charge(self, charge: Charge, after_commit: AfterCommit) -> asyncio.Future[bool]:
        """Resolves to True once the charge (and the end of its reservation) is committed and
        `after_commit` has run."""
        return self._submit(charge=charge, after_commit=after_commit)

    def release(self, request_id: str) -> None:
        """End the reservation of a request that never ran, with the next batch."""
        self._submit(released=request_id)

    def refuse(self, refused: Refused) -> None:
        """Record a request a limit refused, with the next batch."""
        self._submit(refused=refused)

    async def flush(self) -> None:
        """Wait until everything submitted so far is committed (or given up on)."""
        await self._queue.join()

    async def close(self) -> None:
        if self._task is not None:
            await self.flush()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _submit(
        self,
        reserved: Reservation | None = None,
        charge: Charge | None = None,
        released: str | None = None,
        after_commit: AfterCommit | None = None,
        refused: Refused | None = None,
    ) -> asyncio.Future[bool]:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="tether-ledger-writer")
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Write(done, reserved, charge, released, refused, after_commit))
        return done

    async def _run(self) -> None:
        while True:
            # no lingering for company: whatever queued while the last commit ran shares the next one
            batch = [await self._queue.get()]
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                committed = await self._commit(batch)
                if committed:
                    await asyncio.gather(*(self._after(w) for w in batch if w.after_commit is not None))
                for write in batch:
                    if not write.done.done():
                        write.done.set_result(committed)
            finally:
                for _ in batch:
                    self._queue.task_done()

    @staticmethod
    async def _after(write: _Write) -> None:
        assert write.after_commit is not None
        try:
            await write.after_commit()
        except Exception:
            logger.exception("settling after a ledger commit failed")

    async def _commit(self, batch: list[_Write]) -> bool:
        charges = [w.charge for w in batch if w.charge is not None]
        reserved = [w.reserved for w in batch if w.reserved is not None]
        released = [w.released for w in batch if w.released is not None]
        refused = [w.refused for w in batch if w.refused is not None]
        for attempt in range(1, self.attempts + 1):
            try:
                await asyncio.to_thread(self.ledger.record, charges, reserved, released, refused)
                return True
            except Exception:
                logger.exception(
                    "ledger write of %d charges and %d reservations failed (attempt %d/%d)",
                    len(charges),
                    len(reserved),
                    attempt,
                    self.attempts,
                )
                if attempt < self.attempts:
                    await asyncio.sleep(self.backoff_s * attempt)
        for charge in charges:
            logger.error("unrecorded charge: %s", {**asdict(charge), "tier": charge.tier.value})
        self.on_failure(len(charges))
        return False
