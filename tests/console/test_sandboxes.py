"""The sandboxes page: figures read from sandbox servers' `/metrics`, a server that does not answer shown
as down (never an error page), and a real `tether sandbox serve` watched in the browser."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from fastapi.testclient import TestClient

from tests.live_server import free_port, live_server, sandbox_fleet
from tether.console.app import create_app
from tether.console.config import ConsoleConfig
from tether.console.sandbox_status import parse_figures, quantile

METRICS = """\
# TYPE tether_sandbox_runs counter
tether_sandbox_runs_total{language="python",status="ok"} 8.0
tether_sandbox_runs_total{language="python",status="timeout"} 2.0
# TYPE tether_sandbox_run_seconds histogram
tether_sandbox_run_seconds_bucket{language="python",le="0.1"} 4.0
tether_sandbox_run_seconds_bucket{language="python",le="1.0"} 9.0
tether_sandbox_run_seconds_bucket{language="python",le="+Inf"} 10.0
tether_sandbox_run_seconds_count{language="python"} 10.0
tether_sandbox_run_seconds_sum{language="python"} 3.0
# TYPE tether_sandbox_slots gauge
tether_sandbox_slots 4.0
# TYPE tether_sandbox_busy_slots gauge
tether_sandbox_busy_slots 3.0
# TYPE tether_sandbox_qc_failures counter
tether_sandbox_qc_failures_total 1.0
# TYPE tether_sandbox_workers_replaced counter
tether_sandbox_workers_replaced_total 2.0
"""


def test_figures_are_read_from_prometheus_text() -> None:
    figures = parse_figures(METRICS)
    assert figures.runs == 10 and figures.runs_by_status == {"ok": 8, "timeout": 2}
    assert (figures.slots, figures.busy_slots, figures.free_slots) == (4, 3, 1)
    assert (figures.qc_failures, figures.workers_replaced) == (1, 2)
    assert figures.latency_buckets == ((0.1, 4.0), (1.0, 9.0), (float("inf"), 10.0))


def test_quantiles_interpolate_inside_their_bucket_as_prometheus_does() -> None:
    buckets = ((0.1, 4.0), (1.0, 9.0), (float("inf"), 10.0))
    assert quantile(buckets, 0.2) == pytest.approx(0.05)  # rank 2 of 4 in [0, 0.1]
    assert quantile(buckets, 0.5) == pytest.approx(0.1 + 0.9 * (1 / 5))  # rank 5: first of (0.1, 1]
    assert quantile(buckets, 0.99) == 1.0  # in the +Inf bucket: its lower bound
    assert quantile((), 0.5) is None and quantile(((1.0, 0.0),), 0.5) is None


def _client(*urls: str) -> TestClient:
    return TestClient(create_app(ConsoleConfig(runs=(), sandbox_urls=urls)))


def test_a_server_that_does_not_answer_shows_as_down_not_as_an_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with _client(url) as client:
        page = client.get("/sandboxes")
        assert page.status_code == 200
        assert 'data-up="false"' in page.text and "no answer" in page.text
        (server,) = client.get("/api/sandboxes").json()["sandboxes"]
        assert server["up"] is False and server["url"] == url and "ConnectError" in server["problem"]


def test_a_server_whose_metrics_are_not_prometheus_text_shows_as_down() -> None:
    garbage = FastAPI()
    garbage.get("/metrics")(lambda: PlainTextResponse("this is {not prometheus"))
    with live_server(garbage) as url, _client(url) as client:
        (server,) = client.get("/api/sandboxes").json()["sandboxes"]
        assert server["up"] is False and "not Prometheus text" in server["problem"]
        assert client.get("/sandboxes/panel").status_code == 200


def test_without_sandbox_servers_the_page_says_how_to_add_one() -> None:
    with _client() as client:
        page = client.get("/sandboxes")
        assert page.status_code == 409 and "--sandbox-url" in page.text
        assert client.get("/api/sandboxes").json()["error"]["code"] == "not_configured"


def test_a_real_sandbox_server_shows_its_runs_latency_and_failures(page: object, shots: Path) -> None:
    from playwright.sync_api import Page, expect

    assert isinstance(page, Page)
    with sandbox_fleet(1, "--slots", "2") as [(_, sandbox)]:
        for code in ("print('ok')", "print('ok')", "import sys; sys.exit(3)"):
            answer = httpx.post(f"{sandbox}/v1/run", json={"code": code, "language": "python"}, timeout=30)
            assert answer.status_code == 200
        down = f"http://127.0.0.1:{free_port()}"
        with live_server(create_app(ConsoleConfig(runs=(), sandbox_urls=(sandbox, down), poll_s=1.0))) as url:
            page.goto(f"{url}/sandboxes")
            row = page.locator('tr[data-up="true"]')
            expect(row.locator('[data-cell="runs"]')).to_have_text("3")
            assert float(row.locator('[data-cell="p50"]').inner_text()) > 0
            expect(page.locator('tr[data-up="false"]')).to_have_count(1)
            expect(page.locator('.sandbox-failures tr[data-status="runtime_error"]')).to_have_count(1)
            httpx.post(f"{sandbox}/v1/run", json={"code": "print(1)", "language": "python"}, timeout=30)
            # the page polls: the new run and a rate from the counters' delta appear without a reload
            expect(row.locator('[data-cell="runs"]')).to_have_text("4", timeout=10_000)
            expect(row.locator('[data-cell="runs-per-s"]')).not_to_have_text("-", timeout=10_000)
            page.screenshot(path=shots / "sandboxes.png", full_page=True)
