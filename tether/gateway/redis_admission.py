"""Admission shared by gateway instances through Redis: per pool, at most `max_in_flight` requests of all
instances together reach the pool (`AdmissionQueue` counts one process only).

A slot is a lease: a member of the pool's holders sorted set, scored by its expiry and renewed every
lease_s / 3 while its request runs. One Lua script drops expired holders and admits only while fewer than
`max_in_flight` remain, so a gateway killed with SIGKILL keeps its slots at most one lease longer. Expiry
uses Redis's clock (`TIME`), so the instances' clocks need not agree on it.

Waiting: each instance keeps its own bounded queue (fast tier first, arrival order within a tier, each up
to `queue_deadline_s`) and only its best waiters (up to `_BATCH`) compete, in one script per try. Competing
waiters of all instances are a second sorted set ordered by (priority, arrival), and one is admitted only
while its rank is below the number of free slots. Guaranteed: a freed slot goes to the best competing
waiter of any instance, so a fast-tier request waiting anywhere goes before every standard one. Not
guaranteed: arrival order across instances follows their wall clocks (FIFO within a tier is as good as
their NTP); an instance's waiters beyond its best `_BATCH` compete only once those got in; a dead
instance's competing waiters (and one that stopped competing) keep their places for at most one lease.
A release publishes a notice that wakes the waiting instances at once; each also re-checks every
`poll_s`, which bounds how late it sees a lost notice or an expired lease.

Redis unreachable: `on_store_down = "refuse"` refuses with 503 + Retry-After naming the store; "local"
admits against this instance's own `AdmissionQueue` (each instance up to `max_in_flight`). The store is
tried again after `STORE_RETRY_S`. Redis >= 5 (scripts replicated by effects, as `TIME` needs).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tether.gateway.admission import AdmissionQueue, AdmissionRefused
from tether.gateway.config import Pool, SharedAdmission, StoreDown

logger = logging.getLogger(__name__)

STORE_RETRY_S = 1.0
"""After Redis failed, requests skip it (refused, or admitted locally) for this long before it is retried."""
_SOCKET_TIMEOUT_S = 2.0
_MAX_CONNECTIONS = 16
_BATCH = 16
"""Waiters of one instance that compete in one script: as many slots as free up at once, up to this."""
_STORE_ERRORS = (RedisError, OSError)

# KEYS: holders, heads, heads' expiry. ARGV: max_in_flight, lease_ms, then per waiter, best first: token,
# member, score (-priority). The waiters compete: each member is added to (or renewed among) the heads, and
# while the next one ranks below the free slots it leaves the heads and its token becomes a holder.
# Returns how many of them, from the first, were admitted; the others stay heads for one lease.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local gone = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
for _, member in ipairs(gone) do redis.call('ZREM', KEYS[2], member) end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local n = (#ARGV - 2) / 3
for i = 1, n do redis.call('ZADD', KEYS[2], ARGV[3*i+2], ARGV[3*i+1]) end
local admitted = 0
for i = 1, n do
  local member = ARGV[3*i+1]
  local free = tonumber(ARGV[1]) - redis.call('ZCARD', KEYS[1])
  if redis.call('ZRANK', KEYS[2], member) >= free then break end
  redis.call('ZREM', KEYS[2], member)
  redis.call('ZADD', KEYS[1], now + lease, ARGV[3*i])
  admitted = admitted + 1
end
for i = admitted + 1, n do redis.call('ZADD', KEYS[3], now + lease, ARGV[3*i+1]) end
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], lease * 3) end
return admitted
"""

# KEYS: holders. ARGV: lease_ms, tokens. Extends the leases still held; returns how many had been dropped.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local lost = 0
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], now + lease, ARGV[i])
  else
    lost = lost + 1
  end
end
redis.call('PEXPIRE', KEYS[1], lease * 3)
return lost
"""

# KEYS: sorted sets. ARGV: channel, then the member to remove from each set. Tells the waiters.
_LEAVE = """
for i = 1, #KEYS do redis.call('ZREM', KEYS[i], ARGV[i + 1]) end
redis.call('PUBLISH', ARGV[1], '')
return 0
"""


def _twice(members: list[str]) -> list[str]:
    """Each member twice: the arguments of `_LEAVE` from the heads and their expiry."""
    return [member for member in members for _ in range(2)]


class _Outcome(Enum):
    SHARED = "shared"
    """A slot counted in Redis."""
    LOCAL = "local"
    """Redis was unreachable: wait for a slot of the local fallback instead."""


@dataclass(eq=False)
class _Waiter:
    priority: int
    member: str
    """Its entry among the competing heads: wall-clock arrival, instance, serial (FIFO within a priority)."""
    future: asyncio.Future[_Outcome]
    registered: bool = False
    """Its member is among the heads in Redis (it competed and was not admitted)."""
    competing: bool = False
    """An acquire script for it is running."""


def display_url(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return parts._replace(netloc=netloc).geturl()


@dataclass
class RedisAdmission:
    """One pool's admission counted in Redis; the same interface as `AdmissionQueue`."""

    name: str
    pool: Pool
    shared: SharedAdmission
    wall_clock: Callable[[], float] = time.time
    """Orders arrivals across instances (FIFO within a tier)."""
    max_in_flight: int = field(init=False)
    _fallback: AdmissionQueue = field(init=False)
    _tokens: list[str] = field(init=False, default_factory=list)
    _waiting: list[tuple[int, str, _Waiter]] = field(init=False, default_factory=list)
    _tasks: set[asyncio.Task[None]] = field(init=False, default_factory=set)
    _competitor: asyncio.Task[None] | None = field(init=False, default=None)
    _background: list[asyncio.Task[None]] = field(init=False, default_factory=list)
    _trying: int = field(init=False, default=0)
    """Acquire scripts running: while one is, new arrivals queue (one try at a time, besides the head's)."""
    _down_until: float = field(init=False, default=float("-inf"))
    _down_reason: str = field(init=False, default="")
    _closing: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.max_in_flight = self.pool.max_in_flight
        self._fallback = AdmissionQueue(
            self.name, self.pool.max_in_flight, self.pool.max_queued, self.pool.queue_deadline_s
        )
        # a burst waits for a connection rather than failing as if Redis were down
        connections = aioredis.BlockingConnectionPool.from_url(
            self.shared.url,
            max_connections=_MAX_CONNECTIONS,
            timeout=_SOCKET_TIMEOUT_S,
            socket_connect_timeout=_SOCKET_TIMEOUT_S,
            socket_timeout=_SOCKET_TIMEOUT_S,
        )
        self._client: aioredis.Redis = aioredis.Redis(connection_pool=connections)
        self._acquire_script = self._client.register_script(_ACQUIRE)
        self._renew_script = self._client.register_script(_RENEW)
        self._leave_script = self._client.register_script(_LEAVE)
        base = f"{self.shared.prefix}{self.name}:"
        self.holders_key, self.heads_key = base + "holders", base + "heads"
        self._heads_expiry_key, self._channel = base + "heads:expiry", base + "released"
        self._instance = uuid.uuid4().hex[:12]
        self._serial = itertools.count()
        self._lease_ms = round(self.shared.lease_s * 1000)
        self._wake = asyncio.Event()

    @property
    def in_flight(self) -> int:
        return len(self._tokens) + self._fallback.in_flight

    @property
    def depth(self) -> int:
        return self._live_waiters() + self._fallback.depth

    def _live_waiters(self) -> int:
        return sum(not waiter.future.done() for _, _, waiter in self._waiting)

    async def acquire(self, priority: int) -> None:
        self._start()
        if time.monotonic() < self._down_until:
            await self._acquire_while_down(priority)
            return
        arrived = time.monotonic()
        future: asyncio.Future[_Outcome] = asyncio.get_running_loop().create_future()
        member = f"{round(self.wall_clock() * 1e6):017d}:{self._instance}:{next(self._serial):012d}"
        waiter = _Waiter(priority, member, future)
        if not self._live_waiters() and not self._trying:  # nobody waits here: compete at once
            try:
                tokens = await self._compete([waiter])
            except _STORE_ERRORS as error:
                self._store_failed(error)
                await self._acquire_while_down(priority)
                return
            if tokens:
                self._tokens += tokens
                return
        if self._live_waiters() >= self.pool.max_queued:
            self._leave_heads(waiter)
            raise self._full()
        # the heads' order in Redis, so that this instance's best registered waiters are the ones competing
        heapq.heappush(self._waiting, (-priority, member, waiter))
        if self._competitor is None or self._competitor.done():
            self._competitor = asyncio.create_task(self._compete_for_waiters())
        self._wake.set()  # a new head may outrank the one competing
        try:
            outcome = await asyncio.wait_for(
                future, self.pool.queue_deadline_s - (time.monotonic() - arrived)
            )
        except TimeoutError:
            self._gave_up(waiter)
            raise AdmissionRefused(
                f"pool {self.name!r} is saturated across gateway instances: waited "
                f"{self.pool.queue_deadline_s:g} s (queue_deadline_s) without a free slot; retry later",
                self.pool.queue_deadline_s,
            ) from None
        except BaseException:
            self._gave_up(waiter)
            raise
        if outcome is _Outcome.LOCAL:
            await self._fallback.acquire(priority)

    def release(self) -> None:
        """Free a slot of this instance: one of the local fallback's first, so that counting returns to
        Redis; the slot is removed from Redis in the background (or expires with its lease)."""
        if self._fallback.in_flight:
            self._fallback.release()
            return
        assert self._tokens, f"pool {self.name!r}: release without a slot"
        token = self._tokens.pop()
        self._spawn(self._leave([self.holders_key], token))

    async def aclose(self) -> None:
        # the loops also stop on this flag: redis-py can swallow a cancellation inside `get_message`
        self._closing = True
        running = [*self._background, *([self._competitor] if self._competitor else [])]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=_SOCKET_TIMEOUT_S)
        for _, _, waiter in self._waiting:
            if not waiter.future.done():
                waiter.future.set_exception(AdmissionRefused("the gateway is shutting down; retry", 1.0))
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=_SOCKET_TIMEOUT_S)
        if self._tokens:  # still held at shutdown: give them back rather than let them expire
            await self._leave([self.holders_key] * len(self._tokens), *self._tokens)
        await self._client.aclose()

    # competing

    async def _compete(self, waiters: list[_Waiter]) -> list[str]:
        """One try of `waiters` (best first) for slots: the tokens of the slots the first of them got; the
        others are registered as heads."""
        tokens = [f"{self._instance}:{next(self._serial)}" for _ in waiters]
        args: list[Any] = [self.max_in_flight, self._lease_ms]
        for token, waiter in zip(tokens, waiters, strict=True):
            args += [token, waiter.member, -waiter.priority]
        keys = [self.holders_key, self.heads_key, self._heads_expiry_key]
        attempt = asyncio.ensure_future(self._acquire_script(keys=keys, args=args))
        for waiter in waiters:
            waiter.competing = True
        self._trying += 1
        try:
            admitted = int(await asyncio.shield(attempt))
        except asyncio.CancelledError:  # the script still runs: undo what it did once it has
            self._spawn(self._undo(attempt, tokens, [waiter.member for waiter in waiters]))
            raise
        finally:
            self._trying -= 1
            for waiter in waiters:
                waiter.competing = False
        for i, waiter in enumerate(waiters):
            waiter.registered = i >= admitted
        return tokens[:admitted]

    async def _undo(self, attempt: asyncio.Future[Any], tokens: list[str], members: list[str]) -> None:
        with contextlib.suppress(*_STORE_ERRORS):  # a failed try took nothing, or its leases expire
            admitted = int(await attempt)
            if admitted:
                await self._leave([self.holders_key] * admitted, *tokens[:admitted])
            if members[admitted:]:
                heads = [self.heads_key, self._heads_expiry_key]
                await self._leave(heads * len(members[admitted:]), *_twice(members[admitted:]))

    async def _compete_for_waiters(self) -> None:
        """Compete with this instance's best waiters until none is left."""
        while not self._closing and (batch := self._best(min(_BATCH, self.max_in_flight))):
            self._wake.clear()
            try:
                tokens = await self._compete(batch)
            except _STORE_ERRORS as error:
                self._store_failed(error)
                continue
            for waiter, token in zip(batch, tokens, strict=False):
                if waiter.future.done():  # admitted after it gave up: pass the slot back
                    self._spawn(self._leave([self.holders_key], token))
                else:
                    self._tokens.append(token)
                    waiter.future.set_result(_Outcome.SHARED)
            for waiter in batch[len(tokens) :]:
                if waiter.future.done():  # it gave up during the try
                    self._leave_heads(waiter)
            if len(tokens) < len(batch):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.shared.poll_s)

    def _best(self, count: int) -> list[_Waiter]:
        """This instance's `count` best live waiters, best first (dropping those that left)."""
        if any(entry[2].future.done() for entry in self._waiting):
            self._waiting = [entry for entry in self._waiting if not entry[2].future.done()]
            heapq.heapify(self._waiting)
        return [waiter for _, _, waiter in heapq.nsmallest(count, self._waiting)]

    def _gave_up(self, waiter: _Waiter) -> None:
        """A waiter left (deadline, cancelled): a slot handed to it as it left goes back."""
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            if future.result() is _Outcome.SHARED:
                self.release()
        elif not future.done():
            future.cancel()
        self._leave_heads(waiter)

    def _leave_heads(self, waiter: _Waiter) -> None:
        """Withdraw a registered waiter from the heads, unless a running try will see that it left."""
        if waiter.registered and not waiter.competing:
            waiter.registered = False
            keys = [self.heads_key, self._heads_expiry_key]
            self._spawn(self._leave(keys, *_twice([waiter.member])))

    # background

    def _start(self) -> None:
        if not self._background:
            self._background = [
                asyncio.create_task(self._renew_forever()),
                asyncio.create_task(self._listen_forever()),
            ]

    async def _renew_forever(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.shared.lease_s / 3)
            if not self._tokens:
                continue
            try:
                lost = await self._renew_script(keys=[self.holders_key], args=[self._lease_ms, *self._tokens])
            except _STORE_ERRORS as error:
                logger.warning("pool %r: cannot renew its slots in Redis (%s); they expire", self.name, error)
                continue
            if lost:
                logger.warning(
                    "pool %r: %d slots expired before their renewal (every %g s): this process or Redis "
                    "stalled past lease_s, so the pool may briefly exceed max_in_flight",
                    self.name,
                    lost,
                    self.shared.lease_s / 3,
                )

    async def _listen_forever(self) -> None:
        """Wake the competing waiter on every release notice; reconnect (polling meanwhile) when cut."""
        while not self._closing:
            try:
                async with self._client.pubsub() as pubsub:
                    await pubsub.subscribe(self._channel)
                    while not self._closing:
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                        if message is not None:
                            self._wake.set()
            except _STORE_ERRORS:
                await asyncio.sleep(STORE_RETRY_S)

    async def _leave(self, keys: list[str], *members: str) -> None:
        try:
            await self._leave_script(keys=keys, args=[self._channel, *members])
        except _STORE_ERRORS as error:
            logger.warning(
                "pool %r: cannot give %s back to Redis (%s); it expires within lease_s = %g s",
                self.name,
                members,
                error,
                self.shared.lease_s,
            )
        self._wake.set()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # refusals and the store being down

    def _store_failed(self, error: BaseException) -> None:
        self._down_until = time.monotonic() + STORE_RETRY_S
        self._down_reason = f"{type(error).__name__}: {error}"
        logger.warning("pool %r: shared admission store unreachable: %s", self.name, self._down_reason)
        waiters = [waiter for _, _, waiter in self._waiting if not waiter.future.done()]
        self._waiting.clear()
        for waiter in waiters:
            if self.shared.on_store_down is StoreDown.LOCAL:
                waiter.future.set_result(_Outcome.LOCAL)
            else:
                waiter.future.set_exception(self._down())

    async def _acquire_while_down(self, priority: int) -> None:
        if self.shared.on_store_down is StoreDown.REFUSE:
            raise self._down()
        await self._fallback.acquire(priority)

    def _down(self) -> AdmissionRefused:
        return AdmissionRefused(
            f"pool {self.name!r}: the shared admission store {display_url(self.shared.url)} is unreachable "
            f"({self._down_reason}), so requests are refused (shared_admission.on_store_down = "
            f"'refuse'); retry later",
            STORE_RETRY_S,
            code="admission_store_unavailable",
        )

    def _full(self) -> AdmissionRefused:
        return AdmissionRefused(
            f"pool {self.name!r} is saturated: {self._live_waiters()} requests queued on this gateway "
            f"instance (max_queued {self.pool.max_queued}) behind {self.max_in_flight} running across "
            "instances; retry later",
            1.0,
        )
