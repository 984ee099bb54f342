"""One pool's engine replicas at work: sending a request to the replica `routing.Router` chooses, trying
another when the first fails before anything reached the client, and checking every replica's health in
the background. The decisions are the router's; this module only does the I/O and reports back to it.

Failover: a request whose connection fails, that is answered 5xx, or whose answer breaks off before its
end (a whole answer) or before its first chunk (a stream) is sent to another replica, up to
`Pool.max_attempts` replicas; the client sees only the last attempt. Once a stream's first chunk is
read the request belongs to that replica: a failure after it ends the stream as before (`relay.py`).
A failed connection or a broken-off answer also counts as a failed health check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tether.gateway.config import Pool
from tether.gateway.metrics import GatewayMetrics
from tether.gateway.plan import Kind
from tether.gateway.routing import Health, Replica, Router
from tether.gateway.upstream import Response, Target, Upstream, UpstreamError

logger = logging.getLogger(__name__)

PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "text": "/v1/completions"}
"""Each completion kind's path, on the gateway and on its engines alike."""


@dataclass(frozen=True, slots=True)
class Whole:
    """A whole answer, read through (any status)."""

    status_code: int
    content: bytes


class Streamed:
    """A 200 stream whose first chunk is already read; the replica counts it as running until closed."""

    status_code = 200

    def __init__(
        self,
        response: Response,
        chunks: AsyncIterator[bytes],
        first: bytes,
        pool: ReplicaPool,
        replica: Replica,
    ) -> None:
        self._response, self._chunks, self._first = response, chunks, first
        self._pool, self._replica = pool, replica
        self._closed = False

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        if self._first:
            yield self._first
        async for chunk in self._chunks:
            yield chunk

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.finished(self._replica)
            await self._response.aclose()


class ReplicaPool:
    def __init__(self, name: str, pool: Pool, upstream: Upstream, metrics: GatewayMetrics) -> None:
        self.name, self.pool, self.upstream, self.metrics = name, pool, upstream, metrics
        urls = [url.rstrip("/") for url in pool.urls]
        self.router = Router(urls, pool.routing, pool.load_factor, pool.virtual_nodes, pool.unhealthy_after)
        self._targets = {
            (i, kind): Target.parse(url + path) for i, url in enumerate(urls) for kind, path in PATHS.items()
        }
        self._health = (
            None
            if pool.health_path is None
            else [Target.parse(url + pool.health_path, "GET") for url in urls]
        )
        self._checks: asyncio.Task[None] | None = None
        for replica in self.router.replicas:
            metrics.replica_up_by(name, replica.url).set(1)

    # sending

    async def send(self, kind: Kind, body: bytes, key: bytes | None, stream: bool) -> Whole | Streamed:
        """The answer of the first replica that gives one; `UpstreamError` when none could be reached."""
        self.start_health_checks()
        tried: set[int] = set()
        error: UpstreamError | None = None
        while len(tried) < self.pool.max_attempts:
            choice = self.router.choose(key, frozenset(tried))
            if choice is None:
                break
            replica = choice.replica
            tried.add(replica.index)
            self.metrics.routed_by(self.name, choice.routed_by.value).inc()
            self.started(replica)
            last = len(tried) == min(self.pool.max_attempts, len(self.router.replicas))
            try:
                response = await self.upstream.post(self._targets[replica.index, kind], body)
                if response.status_code == 200 and stream:
                    try:
                        chunks = aiter(response.aiter_bytes())
                        first = await anext(chunks, b"")
                    except BaseException:
                        await response.aclose()
                        raise
                    if first or last:
                        self._succeeded(replica)
                        return Streamed(response, chunks, first, self, replica)
                    await response.aclose()
                    raise UpstreamError("the stream ended before its first event")
                try:
                    answer = Whole(response.status_code, await response.aread())
                finally:
                    await response.aclose()
            except UpstreamError as failure:
                self.finished(replica)
                self._failed(replica)
                error = failure
                if not last:
                    self.metrics.retries_by(self.name, "connection").inc()
                continue
            except BaseException:
                self.finished(replica)
                raise
            self.finished(replica)
            self._succeeded(replica)
            if answer.status_code < 500 or last:
                return answer
            self.metrics.retries_by(self.name, f"http_{answer.status_code}").inc()
            error = UpstreamError(f"{replica.url} answered HTTP {answer.status_code}")
        assert error is not None
        raise UpstreamError(f"{error} (tried {len(tried)} of {len(self.router.replicas)} replicas)")

    def started(self, replica: Replica) -> None:
        self.router.started(replica)
        self.metrics.replica_in_flight_by(self.name, replica.url).inc()

    def finished(self, replica: Replica) -> None:
        self.router.finished(replica)
        self.metrics.replica_in_flight_by(self.name, replica.url).dec()

    def _failed(self, replica: Replica) -> None:
        if self.router.failed(replica):
            logger.warning(
                "pool %r: replica %s is down (%d failures)", self.name, replica.url, replica.failures
            )
            self.metrics.replica_up_by(self.name, replica.url).set(0)

    def _succeeded(self, replica: Replica) -> None:
        if self.router.succeeded(replica):
            logger.warning("pool %r: replica %s is back", self.name, replica.url)
            self.metrics.replica_up_by(self.name, replica.url).set(1)

    # health

    def start_health_checks(self) -> None:
        """Start checking in the running loop, once (the pool may be built outside it)."""
        if self._health is not None and self._checks is None:
            self._checks = asyncio.get_running_loop().create_task(self._check_forever())

    async def check_once(self) -> None:
        """One GET of every replica's health path at once; 200 passes, anything else fails."""
        assert self._health is not None
        results = await asyncio.gather(*(self._check(target) for target in self._health))
        for replica, ok in zip(self.router.replicas, results, strict=True):
            if ok:
                self._succeeded(replica)
            else:
                self._failed(replica)

    async def _check(self, target: Target) -> bool:
        try:
            async with asyncio.timeout(self.pool.health_timeout_s):
                response = await self.upstream.get(target)
                await response.aread()
        except (UpstreamError, TimeoutError):
            return False
        return response.status_code == 200

    async def _check_forever(self) -> None:
        while True:
            try:
                await self.check_once()
            except Exception:  # a bug here must not stop the checks for good
                logger.exception("pool %r: health checks failed", self.name)
            await asyncio.sleep(self.pool.health_interval_s)

    @property
    def healthy(self) -> int:
        return sum(r.health is Health.UP for r in self.router.replicas)

    async def aclose(self) -> None:
        if self._checks is not None:
            self._checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checks
            self._checks = None
