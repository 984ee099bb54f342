"""SandboxFleet: dispatch, failover and back-pressure over a mocked network, pinned sessions and
SessionLost, discovery with a fake resolver, then the real app and real servers."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tests.live_server import sandbox_fleet
from tether.errors import ConfigError
from tether.sandbox import (
    FleetBusy,
    FleetConfig,
    FleetUnavailable,
    PoolConfig,
    RunStatus,
    SandboxFleet,
    SandboxPool,
    SandboxSpec,
    SessionLost,
    fleet_session,
)
from tether.sandbox.discovery import DiscoveryFailed, DnsDiscovery
from tether.sandbox.server import create_app

OK_RESULT = {"status": "ok", "exit_code": 0, "stdout": "hi\n"}
Answer = httpx.Response | Exception | Callable[[httpx.Request], httpx.Response]


def mock_fleet(
    responses: dict[str, Answer],
    calls: list[str],
    loads: dict[str, dict[str, Any]] | None = None,
    **options: Any,
) -> SandboxFleet:
    """A fleet of hosts answering every request but `GET /v1/load` with `responses[host]`; `calls` logs
    `host` per request (loads are answered from `loads`, or 404: an instance that reports none)."""

    def handle(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/v1/load":
            known = (loads or {}).get(host)
            return httpx.Response(200, json=known) if known else httpx.Response(404)
        calls.append(host)
        answer = responses[host]
        if isinstance(answer, Exception):
            raise answer
        return answer(request) if callable(answer) else answer

    urls = tuple(f"http://{host}:8080" for host in responses)
    config = FleetConfig(endpoints=urls, **options)
    return SandboxFleet(None, config, transport=httpx.MockTransport(handle))


def instance(fleet: SandboxFleet, host: str) -> Any:
    found = fleet.balancer.find(f"http://{host}:8080")
    assert found is not None
    return found


@pytest.mark.parametrize(
    "failure",
    [
        httpx.ConnectError("connection refused"),
        httpx.ReadTimeout("timed out"),
        httpx.Response(500, text="Internal Server Error"),
        httpx.Response(200, text="<html>proxy error page</html>"),
    ],
    ids=["connect-error", "read-timeout", "500", "malformed-200"],
)
async def test_a_run_is_retried_on_another_instance_when_one_fails(failure: Answer) -> None:
    calls: list[str] = []
    async with mock_fleet({"down": failure, "up": httpx.Response(200, json=OK_RESULT)}, calls) as fleet:
        result = await fleet.run("print('hi')")
        assert result.status is RunStatus.OK and result.stdout == "hi\n"
        assert calls == ["down", "up"]
        down = instance(fleet, "down")
        assert down.failures == 1 and not fleet.balancer.up(down) and down.in_flight == 0
        await fleet.run("print('hi')")
        assert calls == ["down", "up", "up"]


async def test_runs_go_to_the_instance_whose_load_shows_free_slots() -> None:
    calls: list[str] = []
    loads = {
        "busy": {"slots": 2, "busy": 2, "queue_depth": 3, "open_sessions": 0, "warm": 0},
        "idle": {"slots": 2, "busy": 0, "queue_depth": 0, "open_sessions": 0, "warm": 2},
    }
    ok = httpx.Response(200, json=OK_RESULT)
    async with mock_fleet({"busy": ok, "idle": ok}, calls, loads) as fleet:
        for _ in range(2):
            await fleet.run("print('hi')")
    assert calls == ["idle", "idle"]


async def test_a_503_with_retry_after_is_back_pressure_not_a_dead_instance() -> None:
    calls: list[str] = []
    full = httpx.Response(
        503,
        headers={"Retry-After": "30"},
        json={"error": {"message": "the run queue is full", "type": "no_free_slot", "field": None}},
    )
    async with mock_fleet({"full": full, "ok": httpx.Response(200, json=OK_RESULT)}, calls) as fleet:
        assert (await fleet.run("print('hi')")).status is RunStatus.OK
        assert calls == ["full", "ok"]
        refused = instance(fleet, "full")
        assert refused.failures == 0 and fleet.balancer.up(refused) and refused.busy_until > 0
        await fleet.run("print('hi')")
        assert calls == ["full", "ok", "ok"]  # backing off, not tried again within its Retry-After


async def test_when_every_instance_refuses_the_run_waits_for_its_retry_after() -> None:
    calls: list[str] = []
    answers = iter([httpx.Response(503, headers={"Retry-After": "0.2"}), httpx.Response(200, json=OK_RESULT)])
    async with mock_fleet({"only": lambda _: next(answers)}, calls) as fleet:
        result = await fleet.run("print('hi')")
    assert result.status is RunStatus.OK and calls == ["only", "only"]


async def test_a_full_fleet_refuses_beyond_its_waiting_line() -> None:
    calls: list[str] = []
    loads = {"a": {"slots": 1, "busy": 1, "queue_depth": 0}}
    async with mock_fleet({"a": httpx.Response(200, json=OK_RESULT)}, calls, loads, max_waiting=0) as fleet:
        with pytest.raises(FleetBusy, match=r"every sandbox instance is full .*max_waiting=0.*1/1 in use"):
            await fleet.run("print(1)")
    assert calls == []


async def test_a_wait_for_capacity_is_bounded() -> None:
    loads = {"a": {"slots": 1, "busy": 1, "queue_depth": 4}}
    ok = httpx.Response(200, json=OK_RESULT)
    async with mock_fleet({"a": ok}, [], loads, wait_timeout_s=0.3, load_interval_s=0.1) as fleet:
        with pytest.raises(FleetBusy, match=r"stayed full for 0\.3 s"):
            await fleet.run("print(1)")


async def test_a_4xx_is_raised_with_the_servers_message_and_not_retried() -> None:
    calls: list[str] = []
    refusal = httpx.Response(
        422,
        json={"error": {"message": "language 'cobol' is not supported", "type": "x", "field": "language"}},
    )
    async with mock_fleet({"a": refusal, "b": refusal}, calls) as fleet:
        with pytest.raises(ConfigError, match="language 'cobol' is not supported"):
            await fleet.run("x", language="cobol")
        assert len(calls) == 1
        assert all(fleet.balancer.up(i) and i.in_flight == 0 for i in fleet.balancer.instances)


async def test_attempts_are_bounded_and_the_error_names_each_failure() -> None:
    calls: list[str] = []
    hosts: dict[str, Answer] = {f"h{n}": httpx.Response(500, text="boom") for n in range(5)}
    async with mock_fleet(hosts, calls, max_attempts=2) as fleet:
        with pytest.raises(FleetUnavailable, match="after 2 attempt") as raised:
            await fleet.run("print(1)")
    assert len(calls) == 2
    for host in calls:
        assert f"http://{host}:8080: HTTP 500: boom" in str(raised.value)


async def test_request_body_carries_bytes_files_and_the_spec() -> None:
    seen: list[dict[str, object]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/load":
            return httpx.Response(404)
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=OK_RESULT)

    spec = SandboxSpec(timeout_s=3, memory_mib=128)
    config = FleetConfig(endpoints=("http://a",))
    async with SandboxFleet(spec, config, transport=httpx.MockTransport(handle)) as fleet:
        await fleet.run(b"print(1)", stdin=b"in", files={"d/x.bin": b"\x00\xff"}, collect=["o"], client="c1")
    body = seen[0]
    assert body["code"] == "print(1)" and body["stdin"] == "in" and body["client"] == "c1"
    assert body["files"] == {"d/x.bin": base64.b64encode(b"\x00\xff").decode()}
    assert body["collect"] == ["o"]
    assert body["spec"] == spec.model_dump(mode="json")


@pytest.mark.parametrize(
    ("options", "phrase"),
    [
        ({}, "exactly one of endpoints"),
        ({"endpoints": ("http://a",), "discovery": "dns+http://s:80"}, "exactly one of endpoints"),
        ({"endpoints": ("localhost:8080",)}, "'localhost:8080'"),
        ({"discovery": "http://sandbox:8080"}, "expected dns\\+http://NAME:PORT"),
        ({"endpoints": ("http://a",), "max_attempts": 0}, "max_attempts = 0"),
        ({"endpoints": ("http://a",), "cooldown_s": -1}, "cooldown_s = -1"),
        ({"endpoints": ("http://a",), "request_timeout_s": 0}, "request_timeout_s = 0"),
        ({"endpoints": ("http://a",), "max_waiting": -1}, "max_waiting = -1"),
    ],
)
def test_bad_fleet_configuration_is_refused_by_name(options: dict[str, Any], phrase: str) -> None:
    with pytest.raises(ConfigError, match=phrase):
        FleetConfig(**options)


async def test_non_utf8_code_is_refused_before_sending() -> None:
    async with mock_fleet({"a": httpx.Response(500)}, []) as fleet:
        with pytest.raises(ConfigError, match="code is not UTF-8"):
            await fleet.run(b"\xff\xfe")


# ---- sessions: pinned, and lost when their instance goes ------------------------------------------------


def session_host(lost_with: httpx.Response | Exception) -> Callable[[httpx.Request], httpx.Response]:
    """An instance that opens sessions, answers one run, then fails every call with `lost_with`."""
    runs = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/v1/sessions":
            return httpx.Response(201, json={"id": "one~s00ff"})
        runs.append(request.url.path)
        if len(runs) == 1:
            assert request.url.path == "/v1/sessions/one~s00ff/run"
            return httpx.Response(200, json=OK_RESULT)
        if isinstance(lost_with, Exception):
            raise lost_with
        return lost_with

    return handle


@pytest.mark.parametrize(
    ("lost_with", "reason"),
    [
        (httpx.ConnectError("connection refused"), "ConnectError: connection refused"),
        (httpx.RemoteProtocolError("peer closed connection"), "RemoteProtocolError"),
        (
            httpx.Response(404, json={"error": {"message": "no open session", "type": "session_not_found"}}),
            "does not know the session",
        ),
    ],
    ids=["refused", "reset", "restarted"],
)
async def test_a_session_is_pinned_and_reported_lost_when_its_instance_is_gone(
    lost_with: httpx.Response | Exception, reason: str
) -> None:
    calls: list[str] = []
    other = httpx.Response(500, text="a session call reached the wrong instance")
    async with mock_fleet({"one": session_host(lost_with), "two": other}, calls) as fleet:
        session = await fleet.open_session()  # "two" fails the open: it goes to "one"
        opened = len(calls)
        holder = instance(fleet, "one")
        assert session.id == "one~s00ff" and holder.in_flight == 1
        assert (await session.run("print('hi')")).stdout == "hi\n"
        with pytest.raises(SessionLost, match=reason) as raised:
            await session.upload({"a.txt": "x"})
        assert raised.value.session_id == "one~s00ff" and raised.value.instance == "http://one:8080"
        assert "one~s00ff" in str(raised.value) and "http://one:8080" in str(raised.value)
        assert calls[opened:] == ["one", "one"]  # never retried elsewhere
        assert holder.in_flight == 0 and holder.failures == 1
        await session.close()  # nothing left to close: no call, no error
        assert len(calls) == opened + 2
        assert instance(fleet, "two").in_flight == 0


async def test_a_missing_file_in_a_session_is_file_not_found_not_a_lost_session() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(201, json={"id": "x~s1"})
        if request.method == "DELETE":
            return httpx.Response(204)
        message = "not in session x~s1: a.txt"
        return httpx.Response(404, json={"error": {"message": message, "type": "file_not_found"}})

    async with mock_fleet({"x": handle}, []) as fleet, await fleet.open_session() as session:
        with pytest.raises(FileNotFoundError, match=r"a\.txt"):
            await session.download(["a.txt"])
        assert not session.closed


async def test_a_session_on_an_instance_that_stops_answering_is_lost_within_its_run_limits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fleet_session, "RUN_MARGIN_S", 0.2)
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        ended: list[str] = []
        spec = SandboxSpec(timeout_s=0.3, compile_timeout_s=0.3)
        async with httpx.AsyncClient() as http:
            session = fleet_session.FleetSession(
                http, url, "hung~s1", spec, release=lambda: ended.append("released"), lost=lambda: None
            )
            started = asyncio.get_running_loop().time()
            with pytest.raises(SessionLost, match="ReadTimeout"):
                await session.run("print(1)")
            waited = asyncio.get_running_loop().time() - started
    assert 0.7 <= waited < 3 and ended == ["released"]


# ---- discovery -----------------------------------------------------------------------------------------


class FakeResolver:
    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.asked: list[tuple[str, int]] = []

    def __call__(self, host: str, port: int, **_: Any) -> list[tuple[Any, ...]]:
        self.asked.append((host, port))
        if not self.addresses:
            raise socket.gaierror(-2, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in self.addresses]


async def test_discovery_resolves_every_address_and_follows_the_fleet_as_it_changes() -> None:
    resolver = FakeResolver("10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::1")
    discovery = DnsDiscovery.parse("dns+http://sandbox.ns.svc:8080", resolver)
    assert await discovery.resolve() == [
        "http://10.0.0.1:8080",
        "http://10.0.0.2:8080",
        "http://[fd00::1]:8080",
    ]
    assert resolver.asked == [("sandbox.ns.svc", 8080)]
    resolver.addresses = []
    with pytest.raises(DiscoveryFailed, match=r"'sandbox\.ns\.svc' does not resolve"):
        await discovery.resolve()


async def test_a_fleet_found_by_discovery_runs_on_the_resolved_instances(pool: SandboxPool) -> None:
    resolver = FakeResolver("127.0.0.1")
    config = FleetConfig(
        discovery="dns+http://localhost:8081", discovery_interval_s=0.05, load_interval_s=0.05
    )
    transport = httpx.ASGITransport(app=create_app(pool))
    fleet = SandboxFleet(None, config, transport=transport, resolver=resolver)
    async with fleet:
        assert [i.url for i in fleet.balancer.instances] == ["http://127.0.0.1:8081"]
        assert (await fleet.run("print(6 * 7)")).stdout == "42\n"
        resolver.addresses = ["127.0.0.2", "127.0.0.1"]
        while len(fleet.balancer.instances) < 2:
            await asyncio.sleep(0.05)
        assert [i.url for i in fleet.balancer.instances] == ["http://127.0.0.1:8081", "http://127.0.0.2:8081"]
        assert all(i.load is not None and i.load.slots == 2 for i in fleet.balancer.instances)


# ---- against the real app ------------------------------------------------------------------------------


async def test_a_fleet_run_and_session_through_the_app_match_a_local_one() -> None:
    config = PoolConfig(slots=2, instance_name="box-0")
    async with SandboxPool(SandboxSpec(timeout_s=10), config) as pool:
        transport = httpx.ASGITransport(app=create_app(pool))
        fleet_config = FleetConfig(endpoints=("http://sandbox",))
        async with SandboxFleet(None, fleet_config, transport=transport) as fleet:
            code = (
                "import sys\nopen('out.txt', 'w').write(open('in.txt').read() * 2)\nprint(sys.stdin.read())"
            )
            result = await fleet.run(code, stdin=b"piped", files={"in.txt": "ab"}, collect=["out.txt"])
            assert result.status is RunStatus.OK and result.stdout == "piped\n"
            assert base64.b64decode(result.files["out.txt"]) == b"abab"
            slow = await fleet.run(
                "import time\ntime.sleep(5)", spec=pool.spec.model_copy(update={"timeout_s": 0.3})
            )
            assert slow.status is RunStatus.TIMEOUT
            with pytest.raises(ConfigError, match="'cobol' is not supported"):
                await fleet.run("x", language="cobol")
            async with await fleet.open_session() as session:
                assert session.id.startswith("box-0~s") and session.id in pool.sessions
                await session.upload({"notes/a.txt": b"\x00one"})
                ran = await session.run("cat notes/a.txt | wc -c > n.txt", "bash")
                assert ran.status is RunStatus.OK
                files = await session.download(["n.txt", "notes/a.txt"])
                assert files == {"n.txt": b"4\n", "notes/a.txt": b"\x00one"}
            assert not pool.sessions and fleet.balancer.instances[0].in_flight == 0


# ---- real servers --------------------------------------------------------------------------------------


@pytest.fixture
def two_servers() -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    with sandbox_fleet(2, "--slots", "2") as servers:
        yield servers


def served_runs(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tether_sandbox_runs_total{")
    )


@pytest_asyncio.fixture
async def remote(two_servers: list[tuple[subprocess.Popen[bytes], str]]) -> AsyncIterator[SandboxFleet]:
    config = FleetConfig(endpoints=tuple(url for _, url in two_servers), cooldown_s=60, load_interval_s=0.2)
    async with SandboxFleet(SandboxSpec(timeout_s=10), config) as fleet:
        yield fleet


async def test_real_servers_share_load_and_survive_one_being_killed(
    two_servers: list[tuple[subprocess.Popen[bytes], str]], remote: SandboxFleet
) -> None:
    (victim, victim_url), (_, survivor_url) = two_servers
    for n in range(4):
        result = await remote.run(f"print({n} * 2)")
        assert result.status is RunStatus.OK and result.stdout == f"{n * 2}\n"
    assert served_runs(victim_url) == 2 and served_runs(survivor_url) == 2

    victim.kill()
    victim.wait()
    for n in range(4):
        result = await remote.run('#include <cstdio>\nint main(){puts("up");}', language="cpp")
        assert result.status is RunStatus.OK and result.stdout == "up\n", n
    assert served_runs(survivor_url) == 6
    dead = remote.balancer.find(victim_url)
    assert dead is not None and dead.failures >= 1 and not remote.balancer.up(dead)
