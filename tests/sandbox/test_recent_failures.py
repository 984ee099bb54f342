"""`GET /v1/recent-failures`: the runs a real pool answered with anything but ok, newest first, bounded."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from tether.sandbox import SandboxPool
from tether.sandbox.failures import RecentFailures
from tether.sandbox.result import RunResult, RunStatus
from tether.sandbox.server import create_app


@pytest_asyncio.fixture
async def client(pool: SandboxPool) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(pool))
    async with httpx.AsyncClient(transport=transport, base_url="http://sandbox") as http:
        yield http


async def test_failed_runs_are_listed_newest_first_with_their_status(client: httpx.AsyncClient) -> None:
    runs = [
        "print('fine')",
        "import sys; sys.stderr.write('boom'); sys.exit(3)",
        "while True: pass",
    ]
    for code, timeout_s in zip(runs, (5, 5, 0.3), strict=True):
        body = {"code": code, "language": "python", "spec": {"timeout_s": timeout_s}}
        assert (await client.post("/v1/run", json=body)).status_code == 200
    answer = await client.get("/v1/recent-failures")
    assert answer.status_code == 200
    failures = answer.json()["failures"]
    assert [f["status"] for f in failures] == ["timeout", "runtime_error"]
    assert failures[1]["exit_code"] == 3 and failures[1]["stderr_tail"] == "boom"
    assert failures[0]["language"] == "python" and failures[0]["at"] >= failures[1]["at"]


@pytest.mark.parametrize("limit", ["0", "101", "many"])
async def test_a_bad_limit_is_a_4xx_naming_it(client: httpx.AsyncClient, limit: str) -> None:
    answer = await client.get("/v1/recent-failures", params={"limit": limit})
    assert answer.status_code == 422
    assert "limit" in answer.text


def test_the_log_keeps_only_the_latest_failures() -> None:
    log = RecentFailures(keep=2)
    for code in range(5):
        log.note("python", RunResult(status=RunStatus.RUNTIME_ERROR, exit_code=code), at=float(code))
    log.note("python", RunResult(status=RunStatus.OK), at=9.0)
    assert [f.exit_code for f in log.latest(10)] == [4, 3]
    assert [f.exit_code for f in log.latest(1)] == [4]
