"""The usage and keys pages in Chromium: a key created and revoked from the UI (and revoked in the
KeyStore), and a 429 from the real gateway, over its limit, counted on the usage page under that limit."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.console.conftest import load_ms
from tests.gateway.conftest import live_gateway, make_config
from tests.live_server import live_server
from tether.chat.pricing import Tier
from tether.console.app import create_app
from tether.console.config import ConsoleConfig
from tether.gateway.bench import MODEL, instant_upstream
from tether.gateway.config import GatewayConfig, Limits
from tether.gateway.runtime import open_stores


def test_a_key_is_created_and_revoked_from_the_keys_page(page: object, shots: Path, tmp_path: Path) -> None:
    from playwright.sync_api import Page, expect

    assert isinstance(page, Page)
    gateway = GatewayConfig(ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}")
    keys, _ = open_stores(gateway)
    with live_server(create_app(ConsoleConfig(runs=(tmp_path,), gateway=gateway))) as url:
        page.goto(f"{url}/usage")  # nothing yet: empty charts and tables, no script error
        assert page.locator("#spend-chart").get_attribute("data-points") is not None
        page.get_by_role("link", name="Keys", exact=True).click()
        form = page.locator("form.key-form")
        form.locator("input[name=tenant]").fill("acme")
        form.locator("select[name=tier]").select_option("fast")
        form.locator("input[name=name]").fill("from the console")
        form.locator("input[name=rpm]").fill("5")
        form.locator("button[type=submit]").click()
        created = page.locator("#flash .key-created")
        expect(created).to_be_visible()
        key_id = created.get_attribute("data-key-id")
        secret = created.locator("code.secret").inner_text()
        row = page.locator(f"#keys-table tr[data-key-id='{key_id}']")
        expect(row.locator(".key-state")).to_have_text("active")  # the table reloaded itself
        record = keys.lookup(secret)
        assert record is not None and record.key_id == key_id and record.limits.requests_per_minute == 5
        page.screenshot(path=shots / "keys.png", full_page=True)

        row.locator("button.revoke").click()
        expect(page.locator("#flash .key-revoked")).to_be_visible()
        expect(row.locator(".key-state")).to_contain_text("revoked")
        assert keys.list("acme")[0].revoked
        form.locator("input[name=tenant]").fill("not a tenant!")
        form.locator("button[type=submit]").click()
        expect(page.locator("#flash .flash-error")).to_contain_text("not a tenant!")
    keys.engine.dispose()


def test_a_429_from_the_gateway_shows_on_the_usage_page_under_its_limit(
    page: object, shots: Path, tmp_path: Path
) -> None:
    from playwright.sync_api import Page, expect

    assert isinstance(page, Page)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    with live_server(instant_upstream) as upstream:
        config = make_config(upstream, f"sqlite:///{tmp_path / 'ledger.db'}", model=MODEL)
        with live_gateway(config) as (gateway_url, gateway):
            secret, key = gateway.keys.create("acme", Tier.STANDARD, Limits(requests_per_minute=1))
            headers = {"Authorization": f"Bearer {secret}"}
            statuses = []
            while 429 not in statuses:
                assert len(statuses) < 5, statuses
                statuses.append(
                    httpx.post(f"{gateway_url}/v1/completions", json=body, headers=headers).status_code
                )
            assert statuses == [200, 429]
        # the gateway has stopped (its writer flushed on close): the console reads only the database
        with live_server(create_app(ConsoleConfig(runs=(tmp_path,), gateway=config))) as url:
            page.goto(f"{url}/usage?days=1")
            assert load_ms(page) < 3000
            refused = page.locator(
                f".usage-refusals tr[data-key-id='{key.key_id}'][data-limit='key requests']"
            )
            expect(refused.locator(".refused-count")).to_have_text("1")
            assert refused.get_attribute("data-status") == "429"
            expect(page.locator(".usage-tiers tr[data-tenant='acme'] .refused-429")).to_have_text("1")
            expect(page.locator("#total-requests")).to_have_text("1")
            assert int(page.locator("#spend-chart").get_attribute("data-points") or 0) >= 24  # hours of a day
            expect(page.locator("#spend-chart .chart-title")).to_have_text("spend (µUSD) per hour")
            page.screenshot(path=shots / "usage.png", full_page=True)
            page.goto(f"{url}/usage/acme")
            expect(page.locator(f"#keys-table tr[data-key-id='{key.key_id}']")).to_be_visible()
            page.goto(f"{url}/usage/nobody")
            assert page.locator(".error-page[data-status='404']").count() == 1
