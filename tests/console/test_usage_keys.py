"""Keys in the console: created from the form with the CLI's own limit checks (secret shown once), revoked
through the KeyStore, every bad input refused with a clear 4xx; and sign-in beyond loopback with the
gateway's admin keys."""

from __future__ import annotations

import html
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tether.chat.pricing import Tier
from tether.console.app import create_app
from tether.console.config import ConsoleConfig
from tether.console.usage import admin_check
from tether.gateway.config import GatewayConfig, Limits
from tether.gateway.keys import KeyStore
from tether.gateway.runtime import open_stores

HTMX = {"HX-Request": "true"}


@pytest.fixture
def gateway(tmp_path: Path) -> GatewayConfig:
    return GatewayConfig(ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}")


@pytest.fixture
def keys(gateway: GatewayConfig) -> Iterator[KeyStore]:
    store, _ = open_stores(gateway)
    yield store
    store.engine.dispose()


@pytest.fixture
def client(gateway: GatewayConfig, tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(ConsoleConfig(runs=(tmp_path,), gateway=gateway))) as opened:
        yield opened


def test_the_form_creates_a_key_with_its_limits_and_shows_the_secret_once(
    client: TestClient, keys: KeyStore
) -> None:
    form = {"tenant": "acme", "tier": "fast", "name": "ci", "rpm": "3", "tokens": "", "budget_usd": "2.50"}
    answer = client.post("/keys", data=form, headers=HTMX)
    assert answer.status_code == 200 and answer.headers["HX-Trigger"] == "keys-changed"
    assert answer.headers["Cache-Control"] == "no-store"
    [record] = keys.list("acme")
    assert record.tier is Tier.FAST and record.name == "ci"
    assert record.limits == Limits(requests_per_minute=3, budget_usd=Decimal("2.50"))
    secret = answer.text.split('<code class="secret">')[1].split("</code>")[0]
    assert keys.lookup(secret) == record
    listed = client.get("/keys").text
    assert record.key_id in listed and secret not in listed


def test_a_key_is_revoked_once_and_then_refused(client: TestClient, keys: KeyStore) -> None:
    _, record = keys.create("acme", Tier.STANDARD, Limits())
    revoked = client.post(f"/keys/{record.key_id}/revoke", headers=HTMX)
    assert revoked.status_code == 200 and "Revoked key" in revoked.text
    assert keys.list("acme")[0].revoked
    again = client.post(f"/keys/{record.key_id}/revoke", headers=HTMX)
    assert (
        again.status_code == 409
        and again.headers["HX-Retarget"] == "#flash"
        and "already revoked" in again.text
    )
    api = client.post(f"/api/keys/{record.key_id}/revoke", headers={"Authorization": "Bearer x"})
    assert api.status_code == 409 and api.json()["error"]["code"] == "already_revoked"


def test_an_unknown_key_id_is_a_404(client: TestClient) -> None:
    page = client.post("/keys/nope/revoke", headers=HTMX)
    assert page.status_code == 404 and "key 'nope': not found" in html.unescape(page.text)
    api = client.post("/api/keys/nope/revoke", headers={"Authorization": "Bearer x"})
    assert api.status_code == 404 and api.json()["error"]["code"] == "unknown_key"


@pytest.mark.parametrize(
    ("form", "says"),
    [
        ({"tenant": "bad name!"}, "tenant 'bad name!'"),
        ({"tenant": ""}, "tenant"),
        ({}, "tenant"),
        ({"tenant": "acme", "rpm": "-1"}, "requests_per_minute = -1"),
        ({"tenant": "acme", "rpm": "many"}, "rpm = 'many'"),
        ({"tenant": "acme", "tokens": "0"}, "tokens_per_window = 0"),
        ({"tenant": "acme", "budget_usd": "lots"}, "budget_usd 'lots'"),
        ({"tenant": "acme", "budget_usd": "NaN"}, "budget_usd"),
        ({"tenant": "acme", "token_window_s": "-5"}, "token_window_s = -5"),
        ({"tenant": "acme", "tier": "gold"}, "tier = 'gold'"),
        ({"tenant": "acme", "admin": "on"}, "unknown key 'admin'"),
        ({"tenant": "acme", "name": "x" * 200}, "name"),
    ],
)
def test_a_bad_form_is_refused_in_the_flash_area_and_creates_nothing(
    client: TestClient, keys: KeyStore, form: dict[str, str], says: str
) -> None:
    answer = client.post("/keys", data=form, headers=HTMX)
    assert answer.status_code == 400 and answer.headers["HX-Retarget"] == "#flash"
    assert says in html.unescape(answer.text) and "Traceback" not in answer.text
    assert keys.list() == []
    api = client.post("/api/keys", json=form, headers={"Authorization": "Bearer x"})
    assert api.status_code == 400 and api.json()["error"]["type"] == "invalid_request_error"


def test_the_api_creates_a_key_and_lists_it_without_its_secret(client: TestClient) -> None:
    made = client.post("/api/keys", json={"tenant": "acme", "rpm": 5}, headers={"Authorization": "Bearer x"})
    assert made.status_code == 201 and made.json()["key"].startswith("tk-")
    listed = client.get("/api/keys?tenant=acme").json()
    assert [(k["key_id"], k["limits"]) for k in listed] == [
        (made.json()["key_id"], {"requests_per_minute": 5})
    ]
    assert made.json()["key"] not in str(listed)


def test_a_form_post_without_the_consoles_header_is_refused(client: TestClient, keys: KeyStore) -> None:
    assert client.post("/keys", data={"tenant": "acme"}).status_code == 403
    assert keys.list() == []


def test_beyond_loopback_only_a_live_admin_key_signs_in(
    gateway: GatewayConfig, keys: KeyStore, tmp_path: Path
) -> None:
    admin_secret, admin = keys.create("ops", Tier.STANDARD, Limits(), admin=True)
    plain_secret, _ = keys.create("ops", Tier.STANDARD, Limits())
    config = ConsoleConfig(runs=(tmp_path,), gateway=gateway, host="0.0.0.0")
    with TestClient(create_app(config, admin_check(gateway))) as client:

        def status(token: str | None) -> int:
            headers = {} if token is None else {"Authorization": f"Bearer {token}"}
            return client.get("/api/usage", headers=headers).status_code

        assert status(None) == 401
        assert status(plain_secret) == 403 and status("tk-made-up") == 403
        assert status(admin_secret) == 200
        signed = client.post("/login", data={"token": admin_secret}, headers=HTMX)
        assert signed.status_code == 204 and client.get("/usage").status_code == 200
        keys.revoke(admin.key_id)
        assert status(admin_secret) == 403
        assert client.get("/usage").status_code == 403  # the cookie's key is revoked too
        client.cookies.clear()
        assert client.post("/login", data={"token": plain_secret}, headers=HTMX).status_code == 403
