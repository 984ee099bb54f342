"""RemoteSandboxPool: load spreading and failover (pure balancer, mocked network), then real servers."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import pytest_asyncio

from tether.errors import ConfigError
from tether.sandbox import RunStatus, SandboxPool, SandboxSpec
from tether.sandbox.remote import Balancer, RemoteSandboxPool, RemoteUnavailable
from tether.sandbox.server import create_app

OK_RESULT = {"status": "ok", "exit_code": 0, "stdout": "hi\n"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- the balancer (pure) -------------------------------------------------------------------------------


def test_balancer_rotates_between_equally_loaded_endpoints() -> None:
    balancer = Balancer(["a", "b", "c"], cooldown_s=10, clock=FakeClock())
    picks = []
    for _ in range(6):
        endpoint = balancer.pick(set())
        assert endpoint is not None
        picks.append(endpoint.url)
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_balancer_prefers_the_endpoint_with_fewest_runs_in_flight() -> None:
    balancer = Balancer(["a", "b"], cooldown_s=10, clock=FakeClock())
    a, b = balancer.endpoints
    balancer.begin(a)
    balancer.begin(a)
    balancer.begin(b)
    assert balancer.pick(set()) is b
    balancer.end(a, ok=True)
    balancer.end(a, ok=True)
    assert balancer.pick(set()) is a


def test_balancer_skips_a_failed_endpoint_until_its_cooldown_ends() -> None:
    clock = FakeClock()
    balancer = Balancer(["a", "b"], cooldown_s=10, clock=clock)
    a, b = balancer.endpoints
    balancer.begin(a)
    balancer.end(a, ok=False)
    assert [balancer.pick(set()) for _ in range(3)] == [b, b, b]
    clock.now += 10
    assert {balancer.pick(set()) for _ in range(2)} == {a, b}


def test_balancer_tries_the_soonest_recovering_endpoint_when_all_are_unhealthy() -> None:
    clock = FakeClock()
    balancer = Balancer(["a", "b"], cooldown_s=10, clock=clock)
    a, b = balancer.endpoints
    balancer.begin(b)
    balancer.end(b, ok=False)
    clock.now += 1
    balancer.begin(a)
    balancer.end(a, ok=False)
    assert balancer.pick(set()) is b
    assert balancer.pick({"b"}) is a
    assert balancer.pick({"a", "b"}) is None


# ---- the client over a mocked network ------------------------------------------------------------------


def mock_pool(
    responses: dict[str, httpx.Response | Exception], calls: list[str], **options: float
) -> RemoteSandboxPool:
    def handle(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        calls.append(host)
        answer = responses[host]
        if isinstance(answer, Exception):
            raise answer
        return answer

    urls = [f"http://{host}:8080" for host in responses]
    return RemoteSandboxPool(urls, transport=httpx.MockTransport(handle), **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "failure",
    [
        httpx.ConnectError("connection refused"),
        httpx.ReadTimeout("timed out"),
        httpx.Response(503, json={"error": {"message": "overloaded", "type": "x", "field": None}}),
        httpx.Response(500, text="Internal Server Error"),
        httpx.Response(200, text="<html>proxy error page</html>"),
    ],
    ids=["connect-error", "read-timeout", "503", "500", "malformed-200"],
)
async def test_run_fails_over_to_another_instance(failure: httpx.Response | Exception) -> None:
    calls: list[str] = []
    async with mock_pool({"down": failure, "up": httpx.Response(200, json=OK_RESULT)}, calls) as pool:
        result = await pool.run("print('hi')")
        assert result.status is RunStatus.OK and result.stdout == "hi\n"
        assert calls == ["down", "up"]
        down = pool.balancer.endpoints[0]
        assert down.failures == 1 and not pool.balancer.healthy(down)
        await pool.run("print('hi')")
        assert calls == ["down", "up", "up"]


async def test_a_4xx_is_raised_with_the_servers_message_and_not_retried() -> None:
    calls: list[str] = []
    refusal = httpx.Response(
        422,
        json={"error": {"message": "language 'cobol' is not supported", "type": "x", "field": "language"}},
    )
    async with mock_pool({"a": refusal, "b": refusal}, calls) as pool:
        with pytest.raises(ConfigError, match="language 'cobol' is not supported"):
            await pool.run("x", language="cobol")
        assert len(calls) == 1
        assert all(pool.balancer.healthy(e) and e.in_flight == 0 for e in pool.balancer.endpoints)


async def test_attempts_are_bounded_and_the_error_names_each_failure() -> None:
    calls: list[str] = []
    hosts = {f"h{n}": httpx.ConnectError("refused") for n in range(5)}
    async with mock_pool(hosts, calls, max_attempts=2) as pool:  # type: ignore[arg-type]
        with pytest.raises(RemoteUnavailable, match="after 2 attempt") as raised:
            await pool.run("print(1)")
    assert len(calls) == 2
    for host in calls:
        assert f"http://{host}:8080: ConnectError: refused" in str(raised.value)


async def test_request_body_carries_bytes_files_and_the_spec() -> None:
    seen: list[dict[str, object]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=OK_RESULT)

    spec = SandboxSpec(timeout_s=3, memory_mib=128)
    async with RemoteSandboxPool(["http://a"], spec, transport=httpx.MockTransport(handle)) as pool:
        await pool.run(b"print(1)", stdin=b"in", files={"d/x.bin": b"\x00\xff"}, collect=["o"], client="c1")
    body = seen[0]
    assert body["code"] == "print(1)" and body["stdin"] == "in" and body["client"] == "c1"
    assert body["files"] == {"d/x.bin": base64.b64encode(b"\x00\xff").decode()}
    assert body["collect"] == ["o"]
    assert body["spec"] == spec.model_dump(mode="json")


@pytest.mark.parametrize(
    ("endpoints", "options", "phrase"),
    [
        ([], {}, "at least one endpoint"),
        (["localhost:8080"], {}, "'localhost:8080'"),
        (["http://a"], {"max_attempts": 0}, "max_attempts = 0"),
        (["http://a"], {"cooldown_s": -1}, "cooldown_s = -1"),
    ],
)
def test_bad_configuration_is_refused_by_name(
    endpoints: list[str], options: dict[str, float], phrase: str
) -> None:
    with pytest.raises(ConfigError, match=phrase):
        RemoteSandboxPool(endpoints, **options)  # type: ignore[arg-type]


async def test_non_utf8_code_is_refused_before_sending() -> None:
    async with RemoteSandboxPool(
        ["http://a"], transport=httpx.MockTransport(lambda r: httpx.Response(500))
    ) as p:
        with pytest.raises(ConfigError, match="code is not UTF-8"):
            await p.run(b"\xff\xfe")


# ---- against the real app ------------------------------------------------------------------------------


async def test_remote_run_through_the_app_matches_a_local_run(pool: SandboxPool) -> None:
    transport = httpx.ASGITransport(app=create_app(pool))
    async with RemoteSandboxPool(["http://sandbox"], transport=transport) as remote:
        code = "import sys\nopen('out.txt', 'w').write(open('in.txt').read() * 2)\nprint(sys.stdin.read())"
        result = await remote.run(code, stdin=b"piped", files={"in.txt": "ab"}, collect=["out.txt"])
        assert result.status is RunStatus.OK and result.stdout == "piped\n"
        assert base64.b64decode(result.files["out.txt"]) == b"abab"
        slow = await remote.run(
            "import time\ntime.sleep(5)", spec=pool.spec.model_copy(update={"timeout_s": 0.3})
        )
        assert slow.status is RunStatus.TIMEOUT
        with pytest.raises(ConfigError, match="'cobol' is not supported"):
            await remote.run("x", language="cobol")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


SERVE = (
    "import sys\n"
    "from tether.sandbox import PoolConfig, SandboxSpec\n"
    "from tether.sandbox.server import serve\n"
    "serve('127.0.0.1', int(sys.argv[1]), SandboxSpec(timeout_s=10), PoolConfig(slots=2))\n"
)


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return process, f"http://127.0.0.1:{port}"


def wait_ready(process: subprocess.Popen[bytes], url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"server {url} exited with {process.returncode}"
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"server {url} did not become healthy within {timeout_s} s")


@pytest.fixture
def two_servers() -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    servers = [start_server(), start_server()]
    try:
        for process, url in servers:
            wait_ready(process, url)
        yield servers
    finally:
        for process, _ in servers:
            if process.poll() is None:
                process.terminate()
        for process, _ in servers:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def served_runs(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tether_sandbox_runs_total{")
    )


@pytest_asyncio.fixture
async def remote(two_servers: list[tuple[subprocess.Popen[bytes], str]]) -> AsyncIterator[RemoteSandboxPool]:
    async with RemoteSandboxPool([url for _, url in two_servers], cooldown_s=60) as pool:
        yield pool


async def test_real_servers_share_load_and_survive_one_being_killed(
    two_servers: list[tuple[subprocess.Popen[bytes], str]], remote: RemoteSandboxPool
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
    dead = next(e for e in remote.balancer.endpoints if e.url == victim_url)
    assert dead.failures == 1 and not remote.balancer.healthy(dead)
