"""What the console's usage page reads beside the bill: each request a limit refused (which limit, which
status), kept in the ledger's database where another process can read it, and the time to first token."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.live_server import live_server
from tether.chat import Usage
from tether.chat.pricing import Tier
from tether.gateway.bench import MODEL, instant_upstream
from tether.gateway.ledger import Charge, Ledger
from tether.gateway.limits import LimitKind
from tether.gateway.runtime import open_stores
from tether.gateway.usage_log import RefusalCount
from tether.store import make_engine

from .conftest import make_config
from .helpers import serve
from .test_crash import MODEL as FAKE
from .test_crash import fake_engine

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 1}


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with live_server(instant_upstream) as url:
        yield url


async def test_a_refused_request_is_recorded_under_its_limit_and_status(
    upstream: str, tmp_path: Path
) -> None:
    config = make_config(
        upstream,
        f"sqlite:///{tmp_path / 'ledger.db'}",
        model=MODEL,
        tenant_limits={"acme": {"tokens_per_window": 1000}},
    )
    async with serve(config) as served:
        secret = served.key("acme", requests_per_minute=1)
        headers = {"Authorization": f"Bearer {secret}"}
        statuses = [
            (await served.http.post("/v1/completions", json=BODY, headers=headers)).status_code
            for _ in range(3)
        ]
        too_big = {**BODY, "max_tokens": 2000}  # more than the tenant's whole token window: a 400
        other = served.key("acme")
        big = await served.http.post(
            "/v1/completions", json=too_big, headers={"Authorization": f"Bearer {other}"}
        )
        await served.gateway.flush()
        key_id = served.gateway.keys.lookup(secret).key_id  # type: ignore[union-attr]
        other_id = served.gateway.keys.lookup(other).key_id  # type: ignore[union-attr]
    assert statuses == [200, 429, 429] and big.status_code == 400
    _, ledger = open_stores(config)  # another process's view: only the database
    counts = ledger.log.refusal_counts(0.0)
    assert [(c.key_id, c.scope, c.kind, c.status, c.count) for c in counts] == sorted(
        [(key_id, "key", LimitKind.REQUESTS, 429, 2), (other_id, "tenant", LimitKind.TOKENS, 400, 1)]
    )
    assert all(isinstance(c, RefusalCount) and c.tenant == "acme" for c in counts)
    assert ledger.log.refusal_counts(0.0, tenant="other") == []


def test_usage_over_time_sums_each_span_per_tenant_and_tier(tmp_path: Path) -> None:
    ledger = Ledger(make_engine(f"sqlite:///{tmp_path / 'ledger.db'}"))
    ledger.record(
        [
            Charge("a", 3600.0 * 10 + 5, "acme", "k", "m", Tier.STANDARD, Usage(10, 4, 2), Decimal("0.5")),
            Charge(
                "b", 3600.0 * 10 + 50, "acme", "k", "m", Tier.STANDARD, Usage(6, 0, 1), Decimal("0.25"), 0.125
            ),
            Charge("c", 3600.0 * 12, "acme", "k", "m", Tier.FAST, Usage(1, 0, 1), Decimal("1")),
            Charge("d", 3600.0 * 12, "beta", "k", "m", Tier.STANDARD, Usage(1, 1, 1), Decimal("2"), 0.5),
        ]
    )
    spans = ledger.log.usage_over_time(0.0, 3600.0)
    assert [
        (b.start, b.tenant, b.tier, b.requests, b.prompt_tokens, b.cached_tokens, b.cost_usd) for b in spans
    ] == [
        (36000.0, "acme", Tier.STANDARD, 2, 16, 4, Decimal("0.75")),
        (43200.0, "acme", Tier.FAST, 1, 1, 0, Decimal("1")),
        (43200.0, "beta", Tier.STANDARD, 1, 1, 1, Decimal("2")),
    ]
    assert [b.tenant for b in ledger.log.usage_over_time(40000.0, 3600.0, tenant="beta")] == ["beta"]
    times = ledger.log.first_token_times(0.0)
    assert sorted((t.tenant, t.seconds) for t in times) == [("acme", 0.125), ("beta", 0.5)]
    assert [t.seconds for t in ledger.log.first_token_times(0.0, tenant="acme")] == [0.125]


async def test_a_streamed_requests_time_to_first_token_is_recorded_with_its_charge(tmp_path: Path) -> None:
    with live_server(fake_engine) as upstream:
        config = make_config(upstream, f"sqlite:///{tmp_path / 'ledger.db'}", model=FAKE)
        async with serve(config) as served:
            headers = {"Authorization": f"Bearer {served.key('acme')}"}
            body = {"model": FAKE, "prompt": "hi", "max_tokens": 1, "stream": True}
            streamed = await served.http.post("/v1/completions", json=body, headers=headers)
            whole = await served.http.post("/v1/completions", json={**body, "stream": False}, headers=headers)
            await served.gateway.flush()
    assert streamed.status_code == whole.status_code == 200
    _, ledger = open_stores(config)
    [timing] = ledger.log.first_token_times(0.0)  # the whole answer has no first token of its own
    assert timing.tenant == "acme" and timing.tier is Tier.STANDARD and 0 < timing.seconds < 5


def test_a_ledger_from_before_the_hourly_sums_gains_them_from_its_charges(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'old.db'}")
    ledger = Ledger(engine)
    day = 86400.0
    ledger.record(
        [
            Charge("a", day + 10, "acme", "k", "m", Tier.STANDARD, Usage(10, 4, 2), Decimal("0.5")),
            Charge("b", day + 7300, "acme", "k", "m", Tier.STANDARD, Usage(6, 0, 1), Decimal("0.25")),
            Charge("c", 3 * day, "acme", "k", "m", Tier.STANDARD, Usage(1, 0, 1), Decimal("1")),
        ]
    )
    before = ledger.log.usage_over_time(0.0, day)
    with engine.begin() as conn:  # the database as it was before the usage log
        for table in ("gw_usage_hourly", "gw_refusals", "gw_first_tokens"):
            conn.execute(sa.text(f"DROP TABLE {table}"))
    reopened = Ledger(engine)
    assert reopened.log.usage_over_time(0.0, day) == before
    assert [(b.start, b.requests, b.cost_usd) for b in before] == [
        (day, 2, Decimal("0.75")),
        (3 * day, 1, Decimal("1")),
    ]
    assert reopened.log.refusal_counts(0.0) == [] and Ledger(engine).log.usage_over_time(0.0, day) == before
