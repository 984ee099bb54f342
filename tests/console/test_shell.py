"""The console's shell: routing, refusals, access rules and its vendored libraries in a real browser."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.console.conftest import load_ms
from tests.live_server import live_server
from tether.console.app import create_app
from tether.console.config import ConsoleConfig
from tether.errors import ConfigError


def _client(tmp_path: Path, **given: object) -> TestClient:
    return TestClient(create_app(ConsoleConfig(runs=(tmp_path,), **given)))  # type: ignore[arg-type]


def test_an_unknown_api_path_answers_404_json_in_the_openai_error_shape(tmp_path: Path) -> None:
    answer = _client(tmp_path).get("/api/no/such/thing")
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "unknown_page"


def test_an_unknown_page_is_a_page_that_says_so_not_a_traceback(tmp_path: Path) -> None:
    answer = _client(tmp_path).get("/no-such-page")
    assert answer.status_code == 404
    assert "text/html" in answer.headers["content-type"]
    assert "/no-such-page: no such page" in answer.text
    assert "Traceback" not in answer.text


def test_an_action_without_the_consoles_header_is_refused(tmp_path: Path) -> None:
    client = _client(tmp_path)
    assert client.post("/logout").status_code == 403
    assert client.post("/logout", headers={"HX-Request": "true"}).status_code == 204


def test_an_action_from_another_origin_is_refused_even_with_the_header(tmp_path: Path) -> None:
    answer = _client(tmp_path).post(
        "/api/logout", headers={"HX-Request": "true", "Origin": "http://evil.example"}
    )
    assert answer.status_code == 403
    assert answer.json()["error"]["code"] == "cross_origin"


def test_a_console_beyond_loopback_cannot_start_without_admin_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="admin keys"):
        create_app(ConsoleConfig(runs=(tmp_path,), host="0.0.0.0"))


def test_beyond_loopback_every_request_needs_an_admin_token(tmp_path: Path) -> None:
    app = create_app(
        ConsoleConfig(runs=(tmp_path,), host="0.0.0.0"), admin_check=lambda token: token == "good"
    )
    client = TestClient(app)
    assert client.get("/api/runs").status_code == 401
    assert client.get("/api/runs", headers={"Authorization": "Bearer bad"}).status_code == 403
    assert client.get("/login").status_code == 200
    signed = client.post("/login", data={"token": "good"}, headers={"HX-Request": "true"})
    assert signed.status_code == 204
    assert client.get("/runs").status_code == 200  # the cookie now carries the token


def test_the_shell_loads_its_libraries_in_chromium(tmp_path: Path, page: object, shots: Path) -> None:
    from playwright.sync_api import Page

    assert isinstance(page, Page)
    with live_server(create_app(ConsoleConfig(runs=(tmp_path,)))) as url:
        page.goto(f"{url}/runs")
        assert page.evaluate("() => typeof htmx === 'object' && typeof uPlot === 'function'")
        assert load_ms(page) < 3000
        page.goto(f"{url}/runs/../../etc/passwd")
        assert page.locator(".error-page").count() == 1
        page.screenshot(path=shots / "not-found.png")
