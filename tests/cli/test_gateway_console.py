"""`tether gateway serve --console`: the console mounted at /console of the gateway's own app, every link
its pages write resolving below the mount, and the gateway's routes still the gateway's."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tether.cli.gateway import CONSOLE_PATH, console_mounts
from tether.gateway import GatewayConfig, Pool, build_gateway, create_gateway_app

LINK = re.compile(r'(?:href|src|hx-get|hx-post|action)="([^"]+)"')


@pytest.fixture
def composed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.setenv("TETHER_HOME", str(tmp_path / "home"))  # the console's default job store
    config = GatewayConfig.model_validate(
        {
            "models": {"tiny": "engine"},
            "pools": {"engine": Pool(urls=["http://127.0.0.1:9"])},
            "ledger_url": f"sqlite:///{tmp_path / 'ledger.db'}",
        }
    )
    gateway = build_gateway(config)
    app = create_gateway_app(gateway)
    for path, mounted in console_mounts(config, "127.0.0.1", 4000).items():
        app.mount(path, mounted)
    with TestClient(app) as client:
        yield client
    asyncio.run(gateway.aclose())


def test_every_link_of_the_mounted_consoles_pages_resolves_under_console(composed: TestClient) -> None:
    seen: set[str] = set()
    for start in ("jobs", "playground", "runs"):
        page = composed.get(f"{CONSOLE_PATH}/{start}")
        assert page.status_code == 200, page.text
        links = {link for link in LINK.findall(page.text) if not link.startswith(("javascript:", "#"))}
        assert links and all(link.startswith(f"{CONSOLE_PATH}/") for link in links), links
        seen |= links
    for link in sorted(seen - {f"{CONSOLE_PATH}/playground/turns", f"{CONSOLE_PATH}/logout"}):
        answer = composed.get(link)
        # a page whose store this console was not given answers 409 with how to give it, not 404
        assert answer.status_code in (200, 409), (link, answer.status_code)
    assert f"{CONSOLE_PATH}/static/console.css" in seen and f"{CONSOLE_PATH}/sandboxes" in seen


def test_the_gateway_routes_stay_the_gateways(composed: TestClient) -> None:
    assert composed.get("/healthz").json()["status"] == "ok"
    assert composed.get("/v1/models").status_code == 401  # the gateway's own key check, not the console
    home = composed.get(f"{CONSOLE_PATH}/", follow_redirects=False)
    assert home.headers["location"] == f"{CONSOLE_PATH}/runs"
