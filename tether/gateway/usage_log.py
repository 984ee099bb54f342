"""What the console's usage pages read and no bill needs, kept in the ledger's database and written in the
ledger's own transactions (`Ledger.record`): the requests a limit refused (which limit, what status the
client got), streams' times to first token, and per tenant, tier and hour the charges' sums, so a page
over months reads some thousand rows instead of every charge.

Every table here is additive: a ledger made before them gains them when it is next opened, the hourly
sums filled once from the charges already there. The log decides nothing; limits never read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from decimal import Decimal
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from tether.chat.pricing import Tier
from tether.gateway.limits import LimitKind

if TYPE_CHECKING:  # a type only: the ledger owns the log
    from tether.gateway.ledger import Charge

HOUR_S = 3600
PICO_PER_USD = Decimal(10) ** 12
_SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_pusd")


@dataclass(frozen=True, slots=True)
class Refused:
    """A request a limit refused: whose, which limit (the key's or the tenant's), and what the client got
    (429 when waiting helps, 400 when the request can never fit)."""

    request_id: str
    at: float
    tenant: str
    key_id: str
    tier: Tier
    scope: str
    kind: LimitKind
    status: int
    code: str


@dataclass(frozen=True, slots=True)
class RefusalCount:
    tenant: str
    key_id: str
    tier: Tier
    scope: str
    kind: LimitKind
    status: int
    count: int
    last_at: float


@dataclass(frozen=True, slots=True)
class UsageBucket:
    """One tenant's charges on one tier within one span of time starting at `start` (epoch seconds)."""

    start: float
    tenant: str
    tier: Tier
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: Decimal


@dataclass(frozen=True, slots=True)
class FirstToken:
    tenant: str
    tier: Tier
    seconds: float


def _tenant_is(column: sa.Column[str], tenant: str | None) -> list[sa.ColumnElement[bool]]:
    return [] if tenant is None else [column == tenant]


class UsageLog:
    def __init__(self, engine: Engine, prefix: str, charges: sa.Table) -> None:
        self.engine = engine
        self.meta = sa.MetaData()
        self.refusals = sa.Table(
            f"{prefix}refusals",
            self.meta,
            sa.Column("request_id", sa.String(64), primary_key=True),
            sa.Column("at", sa.Float, nullable=False),
            sa.Column("tenant", sa.String(64), nullable=False),
            sa.Column("key_id", sa.String(32), nullable=False),
            sa.Column("tier", sa.String(16), nullable=False),
            sa.Column("scope", sa.String(16), nullable=False),
            sa.Column("kind", sa.String(16), nullable=False),
            sa.Column("status", sa.Integer, nullable=False),
            sa.Column("code", sa.String(64), nullable=False),
            sa.Index(f"{prefix}refusals_at", "at"),
        )
        self.first_tokens = sa.Table(
            f"{prefix}first_tokens",
            self.meta,
            sa.Column("request_id", sa.String(64), primary_key=True),
            sa.Column("at", sa.Float, nullable=False),
            sa.Column("tenant", sa.String(64), nullable=False),
            sa.Column("tier", sa.String(16), nullable=False),
            sa.Column("seconds", sa.Float, nullable=False),
            sa.Index(f"{prefix}first_tokens_at", "at"),
        )
        self.hourly = sa.Table(
            f"{prefix}usage_hourly",
            self.meta,
            sa.Column("tenant", sa.String(64), primary_key=True),
            sa.Column("tier", sa.String(16), primary_key=True),
            sa.Column("hour", sa.BigInteger, primary_key=True),  # epoch seconds // 3600
            *(sa.Column(name, sa.BigInteger, nullable=False) for name in _SUMS),
        )
        fresh = not sa.inspect(engine).has_table(self.hourly.name)
        self.meta.create_all(engine)
        insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
        added = insert(self.hourly)
        self._add_hourly = added.on_conflict_do_update(
            index_elements=["tenant", "tier", "hour"],
            set_={name: self.hourly.c[name] + added.excluded[name] for name in _SUMS},
        )
        if fresh:
            self._sum_hours(charges)

    def _sum_hours(self, charges: sa.Table) -> None:
        """Fill the hourly sums from the charges a ledger held before it had them (once, when created)."""
        c = charges.c
        hour = sa.cast(sa.func.floor(c.at / HOUR_S), sa.BigInteger)
        if self.engine.dialect.name == "sqlite":  # SQLite may lack floor(); its cast truncates, as floor here
            hour = sa.cast(c.at / HOUR_S, sa.BigInteger)
        sums = sa.select(
            c.tenant,
            c.tier,
            hour,
            sa.func.count(),
            sa.func.sum(c.prompt_tokens),
            sa.func.sum(c.cached_tokens),
            sa.func.sum(c.completion_tokens),
            sa.func.sum(c.cost_pusd),
        ).group_by(c.tenant, c.tier, hour)
        with self.engine.begin() as conn:
            conn.execute(self.hourly.insert().from_select(["tenant", "tier", "hour", *_SUMS], sums))

    def write(
        self, conn: Connection, charges: Sequence[Charge], pico: Sequence[int], refused: Sequence[Refused]
    ) -> None:
        """In the ledger's transaction: the charges' hourly sums (`pico`: each one's cost) and times to
        first token, and the refusals."""
        if refused:
            conn.execute(
                self.refusals.insert(),
                [{**asdict(r), "tier": r.tier.value, "kind": r.kind.value} for r in refused],
            )
        if not charges:
            return
        first_tokens = [
            {"request_id": c.request_id, "at": c.at, "tenant": c.tenant, "tier": c.tier.value, "seconds": s}
            for c in charges
            if (s := c.first_token_s) is not None
        ]
        if first_tokens:
            conn.execute(self.first_tokens.insert(), first_tokens)
        hours: dict[tuple[str, str, int], list[int]] = {}
        for charge, cost in zip(charges, pico, strict=True):
            sums = hours.setdefault((charge.tenant, charge.tier.value, int(charge.at // HOUR_S)), [0] * 5)
            usage = charge.usage
            for i, amount in enumerate(
                (1, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, cost)
            ):
                sums[i] += amount
        conn.execute(
            self._add_hourly,
            [
                {"tenant": tenant, "tier": tier, "hour": hour, **dict(zip(_SUMS, sums, strict=True))}
                for (tenant, tier, hour), sums in hours.items()
            ],
        )

    def usage_over_time(self, since: float, span_s: float, tenant: str | None = None) -> list[UsageBucket]:
        """Charges of the hours from `since`'s on, summed per tenant, tier and `span_s` (a whole number of
        hours), oldest first."""
        assert span_s >= HOUR_S and span_s % HOUR_S == 0, span_s
        c = self.hourly.c
        span = c.hour // int(span_s // HOUR_S)  # integer division on SQLite and PostgreSQL alike
        query = (
            sa.select(span, c.tenant, c.tier, *(sa.func.sum(c[name]) for name in _SUMS))
            .where(c.hour >= int(since // HOUR_S), *_tenant_is(c.tenant, tenant))
            .group_by(span, c.tenant, c.tier)
            .order_by(span, c.tenant, c.tier)
        )
        with self.engine.connect() as conn:
            return [
                UsageBucket(
                    int(at) * span_s,
                    str(who),
                    Tier(tier),
                    int(n),
                    int(p),
                    int(h),
                    int(o),
                    Decimal(int(pico)) / PICO_PER_USD,
                )
                for at, who, tier, n, p, h, o, pico in conn.execute(query)
            ]

    def refusal_counts(self, since: float, tenant: str | None = None) -> list[RefusalCount]:
        """Requests refused since `since`, counted per key, limit and status (every tenant, or `tenant`)."""
        c = self.refusals.c
        last_at = sa.func.max(c.at)
        query = (
            sa.select(c.tenant, c.key_id, c.tier, c.scope, c.kind, c.status, sa.func.count(), last_at)
            .where(c.at >= since, *_tenant_is(c.tenant, tenant))
            .group_by(c.tenant, c.key_id, c.tier, c.scope, c.kind, c.status)
            .order_by(c.tenant, c.key_id, c.scope, c.kind)
        )
        with self.engine.connect() as conn:
            return [
                RefusalCount(
                    str(who),
                    str(key),
                    Tier(tier),
                    str(scope),
                    LimitKind(kind),
                    int(status),
                    int(n),
                    float(at),
                )
                for who, key, tier, scope, kind, status, n, at in conn.execute(query)
            ]

    def first_token_times(
        self, since: float, tenant: str | None = None, limit: int = 2_000
    ) -> list[FirstToken]:
        """The times to first token of the latest `limit` streamed requests since `since`."""
        c = self.first_tokens.c
        query = (
            sa.select(c.tenant, c.tier, c.seconds)
            .where(c.at >= since, *_tenant_is(c.tenant, tenant))
            .order_by(c.at.desc())
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [FirstToken(str(who), Tier(tier), float(s)) for who, tier, s in conn.execute(query)]

    def drop(self) -> None:
        self.meta.drop_all(self.engine)
