"""The usage pages over a real ledger: sums per tenant and tier, spend over time, 429s by limit, time to
first token, the tenant page, and every bad input answered with a clear page or 4xx JSON."""

from __future__ import annotations

import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tether.chat import Usage
from tether.chat.pricing import Tier
from tether.console.app import create_app
from tether.console.config import ConsoleConfig
from tether.gateway.config import GatewayConfig, Limits
from tether.gateway.ledger import Charge
from tether.gateway.limits import LimitKind
from tether.gateway.runtime import open_stores
from tether.gateway.usage_log import Refused


@pytest.fixture
def gateway(tmp_path: Path) -> GatewayConfig:
    return GatewayConfig(ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}")


@pytest.fixture
def client(gateway: GatewayConfig, tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(ConsoleConfig(runs=(tmp_path,), gateway=gateway))) as opened:
        yield opened


def _spend(gateway: GatewayConfig) -> str:
    """Two tenants' charges an hour apart, one streamed, and three refusals; the key id of acme's key."""
    keys, ledger = open_stores(gateway)
    _, acme = keys.create("acme", Tier.STANDARD, Limits(requests_per_minute=1))
    keys.create("beta", Tier.FAST, Limits())
    now = time.time()
    ledger.record(
        [
            Charge("a", now - 7200, "acme", acme.key_id, "m", Tier.STANDARD, Usage(10, 4, 2), Decimal("0.5")),
            Charge(
                "b", now - 60, "acme", acme.key_id, "m", Tier.STANDARD, Usage(6, 0, 1), Decimal("0.25"), 0.2
            ),
            Charge("c", now - 60, "beta", "k2", "m", Tier.FAST, Usage(1, 1, 1), Decimal("2"), 0.4),
        ],
        refused=[
            Refused(f"r{i}", now - i, "acme", acme.key_id, Tier.STANDARD, "key", LimitKind.REQUESTS, 429, "x")
            for i in range(2)
        ]
        + [Refused("r9", now, "acme", acme.key_id, Tier.STANDARD, "tenant", LimitKind.TOKENS, 400, "y")],
    )
    keys.engine.dispose()
    return acme.key_id


def test_usage_sums_tokens_spend_and_429s_per_tenant_and_tier(
    gateway: GatewayConfig, client: TestClient
) -> None:
    key_id = _spend(gateway)
    body = client.get("/api/usage?days=1").json()
    by = {(u["tenant"], u["tier"]): u for u in body["usage"]}
    acme = by[("acme", "standard")]
    assert acme["requests"] == 2 and acme["cost_usd"] == "0.75"
    assert acme["tokens"] == {"cache_hit": 4, "cache_miss": 12, "output": 3}
    assert acme["refused_429"] == 2 and acme["ttft_s"]["p50"] == 0.2
    assert by[("beta", "fast")]["ttft_s"] == {"p50": 0.4, "p95": 0.4}
    assert body["tenants"] == ["acme", "beta"]
    refusals = {(r["key_id"], r["limit"], r["status"]): r["count"] for r in body["refusals"]}
    assert refusals == {(key_id, "key requests", 429): 2, (key_id, "tenant tokens", 400): 1}
    spend = body["spend"]
    assert spend["series"] == ["acme", "beta"] and len(spend["data"][0]) in (24, 25)  # each hour of the day
    assert sum(spend["data"][1]) == 0.75 and sum(spend["data"][2]) == 2.0
    assert sum(1 for value in spend["data"][1] if value) == 2  # acme's two charges were two hours apart


def test_the_usage_page_draws_spend_with_the_charting_library_and_lists_refusals(
    gateway: GatewayConfig, client: TestClient
) -> None:
    key_id = _spend(gateway)
    page = client.get("/usage?days=1")
    assert page.status_code == 200
    assert 'id="spend-chart" data-chart=' in page.text and "spend (USD) per hour" in page.text
    assert f'data-key-id="{key_id}" data-limit="key requests" data-status="429"' in page.text


def test_a_tenant_page_shows_its_tiers_report_and_keys(gateway: GatewayConfig, client: TestClient) -> None:
    key_id = _spend(gateway)
    page = client.get("/usage/acme")
    assert page.status_code == 200
    assert f'<tr data-key-id="{key_id}"' in page.text and 'data-tenant="beta"' not in page.text
    body = client.get("/api/usage/acme").json()
    assert [u["tier"] for u in body["usage"]] == ["standard"] and body["spend"]["series"] == ["standard"]
    assert [k["key_id"] for k in body["keys"]] == [key_id]


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/usage/nobody", 404, "unknown_tenant"),
        ("/usage/bad%20name!", 400, "invalid_input"),
        ("/usage?days=0", 400, "invalid_input"),
        ("/usage?days=lots", 400, "invalid_input"),
        ("/usage/acme?days=9999", 400, "invalid_input"),
        ("/keys?tenant=%2F..", 400, "invalid_input"),
    ],
)
def test_bad_usage_requests_get_a_clear_page_and_4xx_json(
    gateway: GatewayConfig, client: TestClient, path: str, status: int, code: str
) -> None:
    _spend(gateway)
    page = client.get(path)
    assert page.status_code == status and "text/html" in page.headers["content-type"]
    assert "Traceback" not in page.text and f'data-code="{code}"' in page.text
    answer = client.get(f"/api{path}")
    assert answer.status_code == status and answer.json()["error"]["code"] == code


def test_without_a_gateway_ledger_the_pages_say_how_to_give_one(tmp_path: Path) -> None:
    client = TestClient(create_app(ConsoleConfig(runs=(tmp_path,))))
    for path in ("/usage", "/keys"):
        page = client.get(path)
        assert page.status_code == 409 and "--gateway-config or --ledger-url" in page.text
    assert client.get("/api/usage").json()["error"]["code"] == "not_configured"
