"""Rate limits, token windows and spend budgets as sliding-window counters with reservations.

The guarantee: a request is admitted only if, for every counter it touches (requests per minute, tokens
per window, spend per budget period; per key and per tenant), the amounts of all entries younger than the
window plus its own reservation fit the limit, and the check and the reservation of all counters are one
atomic step (one synchronous call in-process, one Lua script in Redis). A reservation is later settled
to the actual amount, which is never larger when the reservation is an upper bound (prompt bytes plus
template overhead plus `max_tokens`, see `ReservationEstimate`): so in every window the settled usage of
admitted requests never exceeds the limit, however many clients or gateway instances run at once. If an
upstream reports more than was reserved, the actual amount is still recorded (the ledger must match the
bill) and that window may overshoot by the difference. Entries keep their admission time.

`LimitCore` below is pure; `MemoryLimitStore` holds it for one process, `RedisLimitStore` mirrors it in Lua.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from tether.gateway.config import Limits

if TYPE_CHECKING:  # a type only: the core stays free of the ledger's SQL
    from tether.gateway.ledger import RecentUsage


class LimitKind(StrEnum):
    REQUESTS = "requests"
    TOKENS = "tokens"
    SPEND = "spend"


@dataclass(frozen=True, slots=True)
class Counter:
    """One sliding window a request is charged to, and the amount it reserves there."""

    name: str
    """Unique per scope and kind, e.g. `key:abc123:tokens`."""
    kind: LimitKind
    scope: str
    """`key` or `tenant`: named in the error a client gets."""
    limit: int
    window_s: float
    amount: int

    def __post_init__(self) -> None:
        assert self.limit >= 1 and self.window_s > 0 and self.amount >= 0, self


@dataclass(frozen=True, slots=True)
class Refusal:
    counter: Counter
    used: int
    retry_after_s: float
    """When enough older entries will have left the window; inf if the request can never fit."""


def counter_name(scope: str, scope_id: str, kind: LimitKind) -> str:
    return f"{scope}:{scope_id}:{kind.value}"


def counters_for(
    limits: Limits, scope: str, scope_id: str, tokens: int, spend_nano_usd: int
) -> list[Counter]:
    """The counters one request is charged to under `limits` of one key or tenant."""
    counters = []
    if limits.requests_per_minute is not None:
        counters.append(
            Counter(
                counter_name(scope, scope_id, LimitKind.REQUESTS),
                LimitKind.REQUESTS,
                scope,
                limits.requests_per_minute,
                60.0,
                1,
            )
        )
    if limits.tokens_per_window is not None:
        counters.append(
            Counter(
                counter_name(scope, scope_id, LimitKind.TOKENS),
                LimitKind.TOKENS,
                scope,
                limits.tokens_per_window,
                limits.token_window_s,
                tokens,
            )
        )
    if limits.budget_usd is not None:
        budget_nano = int(limits.budget_usd * 1_000_000_000)
        counters.append(
            Counter(
                counter_name(scope, scope_id, LimitKind.SPEND),
                LimitKind.SPEND,
                scope,
                budget_nano,
                limits.budget_period_s,
                spend_nano_usd,
            )
        )
    return counters


Entries = dict[str, list[tuple[float, int]]]
"""Counter name -> (at, amount) in time order."""


def longest_window_s(limits: Iterable[Limits]) -> float:
    """How far back the ledger must be read to rebuild the token and spend counters of `limits`."""
    windows = [0.0]
    for each in limits:
        if each.tokens_per_window is not None:
            windows.append(each.token_window_s)
        if each.budget_usd is not None:
            windows.append(each.budget_period_s)
    return max(windows)


def entries_from_ledger(
    usage: Iterable[RecentUsage],
    key_limits: Mapping[str, Limits],
    tenant_limits: Callable[[str], Limits],
    now: float,
) -> Entries:
    """Token and spend window entries rebuilt from recorded charges, so that a restarted process still
    counts what was spent within each window. Requests per minute are not rebuilt: the ledger holds only
    the requests that were charged. Each entry keeps its latest charge's time, so it leaves its window no
    earlier than the charges it stands for."""
    entries: Entries = {}
    for charge in sorted(usage, key=lambda u: u.last_at):
        for scope, scope_id, limits in (
            ("key", charge.key_id, key_limits.get(charge.key_id)),
            ("tenant", charge.tenant, tenant_limits(charge.tenant)),
        ):
            if limits is None:
                continue
            if limits.tokens_per_window is not None and charge.last_at > now - limits.token_window_s:
                name = counter_name(scope, scope_id, LimitKind.TOKENS)
                entries.setdefault(name, []).append((charge.last_at, charge.tokens))
            if limits.budget_usd is not None and charge.last_at > now - limits.budget_period_s:
                name = counter_name(scope, scope_id, LimitKind.SPEND)
                entries.setdefault(name, []).append((charge.last_at, charge.spend_nano_usd))
    return entries


@dataclass(slots=True)
class WindowLog:
    """Entries of one counter in admission order: id -> (admitted at, amount), with their running total."""

    entries: OrderedDict[str, tuple[float, int]] = field(default_factory=OrderedDict)
    total: int = 0

    def expire(self, now: float, window_s: float) -> None:
        while self.entries:
            rid, (at, amount) = next(iter(self.entries.items()))
            if at > now - window_s:
                return
            del self.entries[rid]
            self.total -= amount

    def retry_after_s(self, amount: int, limit: int, now: float, window_s: float) -> float:
        if amount > limit:
            return float("inf")
        freed = 0
        for at, old in self.entries.values():
            freed += old
            if self.total - freed + amount <= limit:
                return max(at + window_s - now, 0.0)
        return 0.0


class LimitCore:
    """All counters of one process; `reserve` checks every counter before charging any."""

    def __init__(self) -> None:
        self.logs: dict[str, WindowLog] = {}

    def reserve(self, reservation_id: str, counters: list[Counter], now: float) -> Refusal | None:
        for counter in counters:
            log = self.logs.setdefault(counter.name, WindowLog())
            log.expire(now, counter.window_s)
            if log.total + counter.amount > counter.limit:
                retry = log.retry_after_s(counter.amount, counter.limit, now, counter.window_s)
                return Refusal(counter, log.total, retry)
        for counter in counters:
            log = self.logs[counter.name]
            log.entries[reservation_id] = (now, counter.amount)
            log.total += counter.amount
        return None

    def seed(self, entries: Entries) -> None:
        """Start counters from earlier usage (see `entries_from_ledger`); before any reservation, since a
        window's entries must stay in time order."""
        for name, items in entries.items():
            log = self.logs.setdefault(name, WindowLog())
            assert not log.entries, f"counter {name} already has entries"
            for i, (at, amount) in enumerate(items):
                log.entries[f"ledger:{i}"] = (at, amount)
                log.total += amount

    def settle(self, reservation_id: str, amounts: dict[str, int]) -> None:
        """Replace reserved amounts with actual ones; entries already out of their window are gone."""
        for name, amount in amounts.items():
            log = self.logs.get(name)
            if log is None or reservation_id not in log.entries:
                continue
            at, old = log.entries[reservation_id]
            log.entries[reservation_id] = (at, amount)
            log.total += amount - old

    def used(self, name: str, now: float, window_s: float) -> int:
        log = self.logs.get(name)
        if log is None:
            return 0
        log.expire(now, window_s)
        return log.total


class LimitStore(Protocol):
    async def reserve(self, reservation_id: str, counters: list[Counter], now: float) -> Refusal | None: ...

    async def settle(self, reservation_id: str, counters: list[Counter], amounts: dict[str, int]) -> None: ...

    async def used(self, counter: Counter, now: float) -> int: ...

    async def close(self) -> None: ...


class MemoryLimitStore:
    """Limits for one gateway process: the event loop makes each call atomic. Its counters start from
    the ledger (`seed`), since a restart must not forget spend within the budget period."""

    def __init__(self) -> None:
        self.core = LimitCore()

    def seed(self, entries: Entries) -> None:
        self.core.seed(entries)

    async def reserve(self, reservation_id: str, counters: list[Counter], now: float) -> Refusal | None:
        return self.core.reserve(reservation_id, counters, now)

    async def settle(self, reservation_id: str, counters: list[Counter], amounts: dict[str, int]) -> None:
        self.core.settle(reservation_id, amounts)

    async def used(self, counter: Counter, now: float) -> int:
        return self.core.used(counter.name, now, counter.window_s)

    async def close(self) -> None:
        return None
