"""What the usage pages show, read from the gateway's keys and ledger in a few queries (never one per
tenant or key): per tenant and tier the requests, tokens (cache hit / miss / output), spend and time to
first token; spend over time; the requests each limit refused. The HTML pages and `/api/usage` both
render a `UsageView`; it does no formatting and knows nothing of HTTP."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from decimal import Decimal

from tether.chat.pricing import Tier
from tether.gateway.keys import ApiKey, KeyStore
from tether.gateway.ledger import Ledger
from tether.gateway.usage_log import RefusalCount, UsageBucket

HOUR_S = 3600.0
DAY_S = 86400.0


@dataclass(slots=True)
class TierUsage:
    """One tenant's use of one tier over the window."""

    tenant: str
    tier: Tier
    requests: int = 0
    cache_hit_tokens: int = 0
    cache_miss_tokens: int = 0
    output_tokens: int = 0
    cost_usd: Decimal = Decimal(0)
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    refused_429: int = 0

    def add(self, bucket: UsageBucket) -> None:
        self.requests += bucket.requests
        self.cache_hit_tokens += bucket.cached_tokens
        self.cache_miss_tokens += bucket.prompt_tokens - bucket.cached_tokens
        self.output_tokens += bucket.completion_tokens
        self.cost_usd += bucket.cost_usd

    def as_json(self) -> dict[str, object]:
        return {
            "tenant": self.tenant,
            "tier": self.tier.value,
            "requests": self.requests,
            "tokens": {
                "cache_hit": self.cache_hit_tokens,
                "cache_miss": self.cache_miss_tokens,
                "output": self.output_tokens,
            },
            "cost_usd": str(self.cost_usd),
            "ttft_s": {"p50": self.ttft_p50_s, "p95": self.ttft_p95_s},
            "refused_429": self.refused_429,
        }


@dataclass(frozen=True, slots=True)
class LimitRefusals:
    """The requests one limit (a key's or a tenant's requests, tokens or spend) refused."""

    tenant: str
    key_id: str
    scope: str
    kind: str
    status: int
    count: int
    last_at: float

    @property
    def limit(self) -> str:
        return f"{self.scope} {self.kind}"

    def as_json(self) -> dict[str, object]:
        return {
            "tenant": self.tenant,
            "key_id": self.key_id,
            "limit": self.limit,
            "status": self.status,
            "count": self.count,
            "last_at": self.last_at,
        }


@dataclass(frozen=True, slots=True)
class UsageView:
    since: float
    span_s: float
    tiers: list[TierUsage]
    refusals: list[LimitRefusals]
    keys: list[ApiKey]
    spend_chart: dict[str, object]
    requests_chart: dict[str, object]
    tenants: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, object]:
        return {
            "since": self.since,
            "span_s": self.span_s,
            "tenants": self.tenants,
            "usage": [tier.as_json() for tier in self.tiers],
            "refusals": [refusal.as_json() for refusal in self.refusals],
            "keys": [key.summary() for key in self.keys],
            "spend": self.spend_chart,
        }


def span_for(days: int) -> float:
    """Hours for a window of up to two days, else days: at most a few hundred points per chart."""
    return HOUR_S if days <= 2 else DAY_S


def _spans(since: float, now: float, span_s: float) -> list[float]:
    """The starts of every span in the window, so a chart's time axis covers it even where nothing ran."""
    first, last = int(since // span_s), int(now // span_s)
    return [n * span_s for n in range(first, last + 1)]


def _chart(
    title: str,
    buckets: list[UsageBucket],
    series_of: dict[str, str],
    value: str,
    spans: list[float],
    scale: float = 1.0,
) -> dict[str, object]:
    """A uPlot spec: x the spans' starts (epoch seconds), one series per name, 0 where a span had none."""
    names = sorted(set(series_of.values()))
    starts = sorted(set(spans) | {bucket.start for bucket in buckets})
    column = {start: i for i, start in enumerate(starts)}
    data: list[list[float]] = [[0.0] * len(starts) for _ in names]
    row = {name: i for i, name in enumerate(names)}
    for bucket in buckets:
        name = series_of[f"{bucket.tenant}/{bucket.tier.value}"]
        data[row[name]][column[bucket.start]] += float(getattr(bucket, value)) * scale
    return {"title": title, "x": "time", "time": True, "series": names, "data": [starts, *data]}


def _spend_unit(buckets: list[UsageBucket]) -> tuple[str, float]:
    """USD, or micro-USD where every span's spend is under a cent (an axis of USD would read 0, 0, 0)."""
    most = max((bucket.cost_usd for bucket in buckets), default=Decimal(0))
    return ("USD", 1.0) if most >= Decimal("0.01") or most == 0 else ("µUSD", 1e6)


def _refusals(counts: list[RefusalCount]) -> list[LimitRefusals]:
    return [
        LimitRefusals(c.tenant, c.key_id, c.scope, c.kind.value, c.status, c.count, c.last_at) for c in counts
    ]


def read_usage(
    keys: KeyStore, ledger: Ledger, days: int, tenant: str | None = None, now: float | None = None
) -> UsageView:
    """Usage of every tenant (or of `tenant`) over the last `days` days."""
    now = time.time() if now is None else now
    since, span_s = now - days * DAY_S, span_for(days)
    buckets = ledger.log.usage_over_time(since, span_s, tenant)
    tiers: dict[tuple[str, Tier], TierUsage] = {}
    for bucket in buckets:
        tiers.setdefault((bucket.tenant, bucket.tier), TierUsage(bucket.tenant, bucket.tier)).add(bucket)
    first_tokens: dict[tuple[str, Tier], list[float]] = defaultdict(list)
    for timing in ledger.log.first_token_times(since, tenant):
        first_tokens[(timing.tenant, timing.tier)].append(timing.seconds)
    counts = ledger.log.refusal_counts(since, tenant)
    for count in counts:
        usage = tiers.setdefault((count.tenant, count.tier), TierUsage(count.tenant, count.tier))
        if count.status == 429:
            usage.refused_429 += count.count
    for (who, tier), seconds in first_tokens.items():
        usage = tiers.setdefault((who, tier), TierUsage(who, tier))
        usage.ttft_p50_s = statistics.median(seconds)
        usage.ttft_p95_s = statistics.quantiles(seconds, n=20)[-1] if len(seconds) > 1 else seconds[0]
    listed = keys.list(tenant)
    tenants = sorted({key.tenant for key in listed} | {who for who, _ in tiers})
    # the overview draws one line per tenant; a tenant's own page one per tier
    series_of = {
        f"{b.tenant}/{b.tier.value}": (b.tier.value if tenant is not None else b.tenant) for b in buckets
    }
    unit = "hour" if span_s == HOUR_S else "day"
    spans = _spans(since, now, span_s)
    currency, scale = _spend_unit(buckets)
    return UsageView(
        since,
        span_s,
        sorted(tiers.values(), key=lambda u: (u.tenant, u.tier.value)),
        _refusals(counts),
        listed,
        _chart(f"spend ({currency}) per {unit}", buckets, series_of, "cost_usd", spans, scale),
        _chart(f"requests per {unit}", buckets, series_of, "requests", spans),
        tenants,
    )
