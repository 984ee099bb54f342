"""The usage ledger: one row per request (tokens, exact cost, tier, model), and per tenant and day the
running spend that budgets and invoices read, both written in one transaction so they never disagree.

Beside them, the reservations of requests forwarded but not yet charged, at their worst-case tokens and
cost: written before a request goes upstream and deleted in the transaction that charges it, so after a
crash the requests it cut short still count against their budgets (see `open_reservations`).

Beside them, in the same transactions, the usage log (`usage_log.py`): what the console's usage pages
read and no bill needs (refusals, times to first token, hourly sums).

Costs are stored as whole pico-dollars (exact: prices have at most 6 decimals per million tokens), so SQL
sums are exact on SQLite and PostgreSQL alike. The ledger knows nothing of HTTP or limits.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine

from tether.chat import Usage
from tether.chat.pricing import Tier
from tether.gateway.usage_log import PICO_PER_USD, Refused, UsageLog


def to_pico_usd(amount: Decimal) -> int:
    pico = amount * PICO_PER_USD
    assert pico == pico.to_integral_value(), f"cost {amount} is finer than a pico-dollar"
    return int(pico)


def day_of(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d")


@dataclass(frozen=True, slots=True)
class Charge:
    request_id: str
    at: float
    tenant: str
    key_id: str
    model: str
    tier: Tier
    usage: Usage
    cost_usd: Decimal
    first_token_s: float | None = None
    """A streamed request's time from arrival to its first chunk; None for a whole answer."""


@dataclass(frozen=True, slots=True)
class Reservation:
    """A request about to be forwarded, at the most it can use: what counts for it until it is charged."""

    request_id: str
    at: float
    tenant: str
    key_id: str
    tokens: int
    spend_nano_usd: int


@dataclass(frozen=True, slots=True)
class UsageRow:
    day: str
    model: str
    tier: Tier
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: Decimal


@dataclass(frozen=True, slots=True)
class RecentUsage:
    """One key's charges within one span of time: when the last of them was made, their tokens, and their
    cost in nano-USD with each charge rounded up, as the limit counters count it."""

    tenant: str
    key_id: str
    last_at: float
    tokens: int
    spend_nano_usd: int


class Ledger:
    def __init__(self, engine: Engine, prefix: str = "gw_") -> None:
        self.engine = engine
        self.meta = sa.MetaData()
        self.rows = sa.Table(
            f"{prefix}usage",
            self.meta,
            sa.Column("request_id", sa.String(64), primary_key=True),
            sa.Column("at", sa.Float, nullable=False),
            sa.Column("day", sa.String(10), nullable=False),
            sa.Column("tenant", sa.String(64), nullable=False),
            sa.Column("key_id", sa.String(32), nullable=False),
            sa.Column("model", sa.String(128), nullable=False),
            sa.Column("tier", sa.String(16), nullable=False),
            sa.Column("prompt_tokens", sa.Integer, nullable=False),
            sa.Column("cached_tokens", sa.Integer, nullable=False),
            sa.Column("completion_tokens", sa.Integer, nullable=False),
            sa.Column("cost_pusd", sa.BigInteger, nullable=False),
            sa.Index(f"{prefix}usage_tenant_at", "tenant", "at"),
        )
        self.spend = sa.Table(
            f"{prefix}spend",
            self.meta,
            sa.Column("tenant", sa.String(64), primary_key=True),
            sa.Column("day", sa.String(10), primary_key=True),
            sa.Column("requests", sa.BigInteger, nullable=False),
            sa.Column("tokens", sa.BigInteger, nullable=False),
            sa.Column("cost_pusd", sa.BigInteger, nullable=False),
        )
        self.reservations = sa.Table(
            f"{prefix}reservations",
            self.meta,
            sa.Column("request_id", sa.String(64), primary_key=True),
            sa.Column("at", sa.Float, nullable=False),
            sa.Column("tenant", sa.String(64), nullable=False),
            sa.Column("key_id", sa.String(32), nullable=False),
            sa.Column("tokens", sa.BigInteger, nullable=False),
            sa.Column("spend_nusd", sa.BigInteger, nullable=False),
        )
        self.meta.create_all(engine)
        self.log = UsageLog(engine, prefix, self.rows)
        # the statements of every commit, built once: SQLAlchemy then reuses their compiled form, where
        # building them per commit cost more than the commit itself
        insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
        spend = insert(self.spend)
        self._add_spend = spend.on_conflict_do_update(
            index_elements=["tenant", "day"],
            set_={
                "requests": self.spend.c.requests + spend.excluded.requests,
                "tokens": self.spend.c.tokens + spend.excluded.tokens,
                "cost_pusd": self.spend.c.cost_pusd + spend.excluded.cost_pusd,
            },
        )
        self._end_reservation = self.reservations.delete().where(
            self.reservations.c.request_id == sa.bindparam("ended")
        )

    def record(
        self,
        charges: Sequence[Charge],
        reserved: Sequence[Reservation] = (),
        released: Sequence[str] = (),
        refused: Sequence[Refused] = (),
    ) -> None:
        """In one transaction, all or nothing: the `reserved` requests' reservations; the `charges`' rows,
        their tenants' daily spend and the end of their reservations; the end of the `released` ones (of
        requests that never ran); the usage log's share of the charges, and the `refused` requests."""
        totals: dict[tuple[str, str], list[int]] = {}
        rows = []
        picos = []
        for charge in charges:
            pico = to_pico_usd(charge.cost_usd)
            picos.append(pico)
            day = day_of(charge.at)
            usage = charge.usage
            total = totals.setdefault((charge.tenant, day), [0, 0, 0])
            total[0] += 1
            total[1] += usage.total_tokens
            total[2] += pico
            rows.append(
                {
                    "request_id": charge.request_id,
                    "at": charge.at,
                    "day": day,
                    "tenant": charge.tenant,
                    "key_id": charge.key_id,
                    "model": charge.model,
                    "tier": charge.tier.value,
                    "prompt_tokens": usage.prompt_tokens,
                    "cached_tokens": usage.cached_tokens,
                    "completion_tokens": usage.completion_tokens,
                    "cost_pusd": pico,
                }
            )
        ended = [*released, *(charge.request_id for charge in charges)]
        if not (rows or reserved or ended or refused):
            return
        with self.engine.begin() as conn:
            self.log.write(conn, charges, picos, refused)
            if reserved:
                conn.execute(
                    self.reservations.insert(),
                    [
                        {
                            "request_id": r.request_id,
                            "at": r.at,
                            "tenant": r.tenant,
                            "key_id": r.key_id,
                            "tokens": r.tokens,
                            "spend_nusd": r.spend_nano_usd,
                        }
                        for r in reserved
                    ],
                )
            if ended:
                conn.execute(self._end_reservation, [{"ended": request_id} for request_id in ended])
            if rows:
                conn.execute(self.rows.insert(), rows)
                conn.execute(
                    self._add_spend,
                    [
                        {
                            "tenant": tenant,
                            "day": day,
                            "requests": requests,
                            "tokens": tokens,
                            "cost_pusd": pico,
                        }
                        for (tenant, day), (requests, tokens, pico) in totals.items()
                    ],
                )

    def report(self, tenant: str, since: float) -> list[UsageRow]:
        """Tokens and cost of `tenant` since `since` (epoch seconds), by day, model and tier."""
        c = self.rows.c
        query = (
            sa.select(
                c.day,
                c.model,
                c.tier,
                sa.func.count(),
                sa.func.sum(c.prompt_tokens),
                sa.func.sum(c.cached_tokens),
                sa.func.sum(c.completion_tokens),
                sa.func.sum(c.cost_pusd),
            )
            .where(c.tenant == tenant, c.at >= since)
            .group_by(c.day, c.model, c.tier)
            .order_by(c.day, c.model, c.tier)
        )
        with self.engine.connect() as conn:
            return [
                UsageRow(
                    str(day),
                    str(model),
                    Tier(tier),
                    int(n),
                    int(p),
                    int(h),
                    int(o),
                    Decimal(int(pico)) / PICO_PER_USD,
                )
                for day, model, tier, n, p, h, o, pico in conn.execute(query)
            ]

    def recent_usage(self, since: float, span_s: float = 60.0) -> list[RecentUsage]:
        """Charges made since `since` (epoch seconds), summed per key and `span_s`, oldest first."""
        c = self.rows.c
        span = sa.cast(c.at / span_s, sa.Integer)  # truncates on SQLite, rounds on PostgreSQL: both group
        last_at = sa.func.max(c.at)
        query = (
            sa.select(
                c.tenant,
                c.key_id,
                last_at,
                sa.func.sum(c.prompt_tokens + c.completion_tokens),
                sa.func.sum((c.cost_pusd + 999) // 1000),
            )
            .where(c.at >= since)
            .group_by(c.tenant, c.key_id, span)
            .order_by(last_at)
        )
        with self.engine.connect() as conn:
            return [
                RecentUsage(str(tenant), str(key_id), float(at), int(tokens), int(nano))
                for tenant, key_id, at, tokens, nano in conn.execute(query)
            ]

    def open_reservations(self, since: float) -> list[RecentUsage]:
        """Reservations made since `since` and never charged nor released, at their worst case: requests
        that were forwarded when the gateway stopped, or whose stream ended without a usage."""
        c = self.reservations.c
        query = (
            sa.select(c.tenant, c.key_id, c.at, c.tokens, c.spend_nusd).where(c.at >= since).order_by(c.at)
        )
        with self.engine.connect() as conn:
            return [
                RecentUsage(str(tenant), str(key_id), float(at), int(tokens), int(nano))
                for tenant, key_id, at, tokens, nano in conn.execute(query)
            ]

    def daily_spend(self, tenant: str, day: str) -> tuple[int, int, Decimal]:
        """(requests, tokens, cost) of `tenant` on `day` from the running totals."""
        c = self.spend.c
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(c.requests, c.tokens, c.cost_pusd).where(c.tenant == tenant, c.day == day)
            ).first()
        if row is None:
            return 0, 0, Decimal(0)
        return int(row[0]), int(row[1]), Decimal(int(row[2])) / PICO_PER_USD

    def drop(self) -> None:
        self.log.drop()
        self.meta.drop_all(self.engine)
