"""Which rollout servers of a fleet are in rotation, when a removed one is probed again, and how a step's
requests are spread over the rotation and re-issued when a server fails: driven by `RemoteRollouts`
(`remote_rollouts.py`), with no I/O of its own (requests are a callable; the clock is passed in).

A server that fails a request, a health check or a weight update is removed and keeps its last error; it
is probed again after `probe_s`, twice as long after each failed probe (at most `PROBE_MAX_S`), and
rejoins only when its caller says it passed a probe and holds the fleet's current weights. What counts as
a server's failure rather than a bad request is the caller's predicate (`server_errors.server_failed`).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from tether.rl.server_errors import ServerError

T = TypeVar("T")

PROBE_MAX_S = 600.0  # a server down for long is still probed every 10 minutes, so it can come back


class ServerStatus(Enum):
    IN_ROTATION = "in rotation"
    REMOVED = "removed"


@dataclass(slots=True)
class ServerHealth:
    url: str
    status: ServerStatus = ServerStatus.IN_ROTATION
    last_error: str | None = None
    failed_probes: int = 0  # since it was removed: the backoff's exponent
    probe_at: float = 0.0  # when a removed server may be probed next (the clock's time)


class FleetUnavailableError(ServerError):
    """No server of the fleet is in rotation: the step cannot go on. Names every server's last error."""


class FleetHealth:
    """The rotation of a fleet of servers, by index; `removals` counts removals since it was last read."""

    def __init__(self, urls: Sequence[str], probe_s: float, clock: Callable[[], float]) -> None:
        assert urls, "a fleet of at least one server"
        assert math.isfinite(probe_s) and probe_s > 0, f"probe_s = {probe_s!r}: expected a number > 0"
        self.servers = [ServerHealth(url) for url in urls]
        self.probe_s = probe_s
        self.clock = clock
        self.removals = 0

    def in_rotation(self) -> list[int]:
        return [i for i, server in enumerate(self.servers) if server.status is ServerStatus.IN_ROTATION]

    def due_for_probe(self) -> list[int]:
        """The removed servers whose wait is over."""
        now = self.clock()
        return [
            i
            for i, server in enumerate(self.servers)
            if server.status is ServerStatus.REMOVED and server.probe_at <= now
        ]

    def remove(self, index: int, error: str) -> bool:
        """Take server `index` out of rotation for `error`; False if it already was out (its error kept:
        the first one says why it went, later ones are its in-flight requests failing with it)."""
        server = self.servers[index]
        if server.status is ServerStatus.REMOVED:
            return False
        server.status = ServerStatus.REMOVED
        server.last_error = error
        server.failed_probes = 0
        server.probe_at = self.clock() + self.probe_s
        self.removals += 1
        return True

    def probe_failed(self, index: int, error: str) -> None:
        server = self.servers[index]
        assert server.status is ServerStatus.REMOVED, f"{server.url} is in rotation: nothing to probe"
        server.failed_probes += 1
        server.last_error = error
        wait_s = min(self.probe_s * 2.0**server.failed_probes, max(self.probe_s, PROBE_MAX_S))
        server.probe_at = self.clock() + wait_s

    def rejoin(self, index: int) -> None:
        """Server `index` passed a probe and holds the fleet's current weights: back in rotation."""
        server = self.servers[index]
        server.status = ServerStatus.IN_ROTATION
        server.last_error = None
        server.failed_probes = 0

    def take_removals(self) -> int:
        removals, self.removals = self.removals, 0
        return removals

    def unavailable(self, doing: str) -> FleetUnavailableError:
        """The error for `doing` (e.g. "generate a step's 8 prompts") with no server in rotation."""
        lines = [f"{server.url}: {server.last_error}" for server in self.servers]
        return FleetUnavailableError(
            f"no rollout server is healthy, so the fleet cannot {doing}; each server's last error:\n  "
            + "\n  ".join(lines)
            + "\nStart them again and resume the run."
        )


@dataclass(frozen=True, slots=True)
class Served(Generic[T]):
    value: T
    attempts: int  # times the request was sent, this last one included


@dataclass(frozen=True, slots=True)
class Unserved:
    """A request every allowed attempt failed at (each on a server that was then removed)."""

    error: str  # the last one
    attempts: int


@dataclass(frozen=True, slots=True)
class Spread(Generic[T]):
    outcomes: list[Served[T] | Unserved]  # one per request, in request order
    reissued: int  # requests sent again because their server failed


async def spread(
    count: int,
    fleet: FleetHealth,
    send: Callable[[int, int], Awaitable[T]],
    attempts: int,
    server_failed: Callable[[BaseException], bool],
) -> Spread[T]:
    """Requests 0..count-1, all at once, `send(request, server)` on the servers in rotation in turn. When
    a server fails one (`server_failed`), it is removed, its other requests in flight are cancelled (they
    would fail or hang the same way), and all of them go to the servers left, each at most `attempts`
    times in all. Any other error is raised as it is; so is `FleetUnavailableError` when requests remain
    and no server does. Nothing is left running on return."""
    assert attempts >= 1, f"attempts = {attempts!r}: expected at least 1"
    outcomes: list[Served[T] | Unserved | None] = [None] * count
    sent = [0] * count
    queue = deque(range(count))
    running: dict[asyncio.Future[T], tuple[int, int]] = {}
    turn = reissued = 0

    def failed(request: int, error: BaseException) -> None:
        nonlocal reissued
        if sent[request] >= attempts:
            outcomes[request] = Unserved(str(error), sent[request])
        else:
            queue.append(request)
            reissued += 1

    def finished(task: asyncio.Future[T], request: int) -> BaseException | None:
        """Records a served request; returns the error of a failed one."""
        error = task.exception() if not task.cancelled() else asyncio.CancelledError()
        if error is None:
            outcomes[request] = Served(task.result(), sent[request])
        return error

    try:
        while queue or running:
            rotation = fleet.in_rotation()
            if queue and not rotation:
                raise fleet.unavailable(f"serve {len(queue)} of the step's {count} requests")
            while queue:
                request = queue.popleft()
                server = rotation[turn % len(rotation)]
                turn += 1
                sent[request] += 1
                running[asyncio.ensure_future(send(request, server))] = (request, server)
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda task: running.get(task, (-1, -1))):  # in request order
                if task not in running:
                    continue  # a sibling of a failed request, already handled below
                request, server = running.pop(task)
                error = finished(task, request)
                if error is None:
                    continue
                if not server_failed(error):
                    raise error
                if fleet.remove(server, str(error)):
                    siblings = [other for other, (_, where) in running.items() if where == server]
                    for other in siblings:
                        other.cancel()
                    await asyncio.gather(*siblings, return_exceptions=True)
                    for other in siblings:
                        sibling, _ = running.pop(other)
                        if finished(other, sibling) is not None:  # one that ended first is kept
                            failed(sibling, error)
                failed(request, error)
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    assert all(outcome is not None for outcome in outcomes)
    return Spread([outcome for outcome in outcomes if outcome is not None], reissued)
