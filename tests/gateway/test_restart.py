"""A restarted gateway with in-process limits rebuilds its token and spend counters from the ledger: spend
within the budget period is still counted, spend older than it is not."""

from __future__ import annotations

import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from tests.live_server import live_server
from tether.gateway import GatewayConfig, Limits, Tier, build_gateway
from tether.gateway.bench import MODEL, instant_upstream
from tether.gateway.ledger import RecentUsage
from tether.gateway.limits import LimitCore, entries_from_ledger

from .conftest import make_config
from .helpers import serve

PERIOD_S = 3600.0
# one request reserves (64 + 2 prompt bytes) x 1.80 + 1 x 9.50 USD per million tokens = 128,300 nano-USD
# and costs 8 x 0.18 + 4 x 1.80 + 1 x 9.50 = 18,140 (the instant upstream's usage): a budget of 140,000
# admits one request, and after it no other
BUDGET = Decimal("0.00014")
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 1}


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with live_server(instant_upstream) as url:
        yield url


def budget_config(upstream: str, tmp_path: Path) -> GatewayConfig:
    return make_config(
        upstream,
        f"sqlite:///{tmp_path / 'ledger.db'}",
        model=MODEL,
        tenant_limits={"acme": {"budget_usd": "1", "budget_period_s": PERIOD_S}},
    )


async def test_a_restarted_gateway_still_counts_spend_within_the_budget_period(
    upstream: str, tmp_path: Path
) -> None:
    config = budget_config(upstream, tmp_path)
    async with serve(config) as first:
        secret, key = first.gateway.keys.create(
            "acme", Tier.STANDARD, Limits(budget_usd=BUDGET, budget_period_s=PERIOD_S, tokens_per_window=100)
        )
        headers = {"Authorization": f"Bearer {secret}"}
        assert (await first.http.post("/v1/completions", json=BODY, headers=headers)).status_code == 200
        await first.gateway.flush()
        before = {name: log.total for name, log in first.gateway.limits.core.logs.items()}  # type: ignore[attr-defined]
    assert before[f"key:{key.key_id}:spend"] == 18_140

    async with serve(config) as restarted:
        after = {name: log.total for name, log in restarted.gateway.limits.core.logs.items()}  # type: ignore[attr-defined]
        assert after == {name: total for name, total in before.items() if not name.endswith(":requests")}
        response = await restarted.http.post("/v1/completions", json=BODY, headers=headers)
        assert response.status_code == 429 and response.json()["error"]["code"] == "budget_exhausted"

    later = build_gateway(config, clock=lambda: time.time() + PERIOD_S + 1)
    try:
        assert later.limits.core.logs == {}  # type: ignore[attr-defined]
    finally:
        await later.aclose()


def test_rebuilt_entries_keep_time_order_and_leave_their_window() -> None:
    usage = [
        RecentUsage("acme", "k1", last_at=50.0, tokens=30, spend_nano_usd=300),
        RecentUsage("acme", "k2", last_at=10.0, tokens=20, spend_nano_usd=200),
        RecentUsage("acme", "k1", last_at=-500.0, tokens=99, spend_nano_usd=999),  # out of the token window
    ]
    key_limits = {"k1": Limits(tokens_per_window=1000, token_window_s=100, budget_usd=Decimal(1))}
    tenant = Limits(budget_usd=Decimal(1), budget_period_s=1000)
    entries = entries_from_ledger(usage, key_limits, lambda _: tenant, now=60.0)
    assert entries == {
        "key:k1:tokens": [(50.0, 30)],
        "key:k1:spend": [(-500.0, 999), (50.0, 300)],
        "tenant:acme:spend": [(-500.0, 999), (10.0, 200), (50.0, 300)],
    }
    core = LimitCore()
    core.seed(entries)
    assert core.used("tenant:acme:spend", now=60.0, window_s=1000) == 1499
    assert core.used("tenant:acme:spend", now=501.0, window_s=1000) == 500  # the oldest left the window
