"""The HTTP API over a real pool: SandboxFusion compatibility, native runs and sessions, errors, ops."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tether.sandbox import PoolConfig, RunResult, RunStatus, SandboxPool, SandboxSpec
from tether.sandbox.fusion import FusionCommandStatus, FusionRunStatus, to_fusion
from tether.sandbox.result import CompileOutput, RunStage
from tether.sandbox.server import create_app

FUSION_RESPONSE_FIELDS = {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}
FUSION_COMMAND_FIELDS = {"status", "execution_time", "return_code", "stdout", "stderr"}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest_asyncio.fixture
async def client(pool: SandboxPool) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(pool))
    async with httpx.AsyncClient(transport=transport, base_url="http://sandbox") as http:
        yield http


def assert_fusion_shape(body: dict[str, Any]) -> None:
    assert set(body) == FUSION_RESPONSE_FIELDS
    assert body["status"] in {"Success", "Failed", "SandboxError"}
    for key in ("compile_result", "run_result"):
        if body[key] is not None:
            assert set(body[key]) == FUSION_COMMAND_FIELDS
            assert body[key]["status"] in {"Finished", "Error", "TimeLimitExceeded"}


# ---- SandboxFusion /run_code ---------------------------------------------------------------------------


async def test_run_code_python_request_as_sandboxfusion_documents_it(client: httpx.AsyncClient) -> None:
    request = {
        "code": "name = input()\nopen('greeting.txt', 'w').write('hi ' + name)\nprint('hello', name)",
        "language": "python",
        "compile_timeout": 10,
        "run_timeout": 10,
        "memory_limit_MB": -1,
        "stdin": "ada\n",
        "files": {"data/input.txt": b64(b"unused")},
        "fetch_files": ["greeting.txt", "not-written.txt"],
    }
    response = await client.post("/run_code", json=request)
    assert response.status_code == 200
    body = response.json()
    assert_fusion_shape(body)
    assert body["status"] == "Success" and body["message"] == ""
    assert body["compile_result"] is None
    run = body["run_result"]
    assert run["status"] == "Finished" and run["return_code"] == 0
    assert run["stdout"] == "hello ada\n" and run["stderr"] == ""
    assert 0 < run["execution_time"] < 10
    assert body["files"] == {"greeting.txt": b64(b"hi ada")}


async def test_run_code_cpp_compiles_then_runs_with_stdin_and_fetch_files(client: httpx.AsyncClient) -> None:
    code = (
        "#include <cstdio>\n"
        'int main() { int a, b; scanf("%d %d", &a, &b); printf("%d\\n", a + b);\n'
        '  FILE *f = fopen("sum.txt", "w"); fprintf(f, "%d", a + b); fclose(f); }\n'
    )
    request = {
        "code": code,
        "language": "cpp",
        "compile_timeout": 10,
        "run_timeout": 10,
        "memory_limit_MB": -1,
        "stdin": "2 40",
        "files": {},
        "fetch_files": ["sum.txt"],
    }
    response = await client.post("/run_code", json=request)
    assert response.status_code == 200
    body = response.json()
    assert_fusion_shape(body)
    assert body["status"] == "Success"
    assert body["compile_result"]["status"] == "Finished" and body["compile_result"]["return_code"] == 0
    assert body["run_result"]["stdout"] == "42\n" and body["run_result"]["return_code"] == 0
    assert body["files"] == {"sum.txt": b64(b"42")}


@pytest.mark.parametrize(
    ("language", "code", "extra", "status", "compile_status", "run_status", "return_code"),
    [
        ("python", "raise SystemExit(3)", {}, "Failed", None, "Finished", 3),
        (
            "python",
            "import time; time.sleep(5)",
            {"run_timeout": 0.3},
            "Failed",
            None,
            "TimeLimitExceeded",
            None,
        ),
        ("python", "x = bytearray(200 * 2**20)", {"memory_limit_MB": 64}, "Failed", None, "Finished", 137),
        ("bash", "echo $((6 * 7))", {}, "Success", None, "Finished", 0),
        ("nodejs", "console.log(6 * 7)", {}, "Success", None, "Finished", 0),
        ("cpp", "int main() { undeclared; }", {}, "Failed", "Finished", None, None),
    ],
    ids=["nonzero-exit", "timeout", "memory-limit", "bash", "nodejs", "compile-error"],
)
async def test_run_code_maps_outcomes_onto_sandboxfusion_statuses(
    client: httpx.AsyncClient,
    language: str,
    code: str,
    extra: dict[str, Any],
    status: str,
    compile_status: str | None,
    run_status: str | None,
    return_code: int | None,
) -> None:
    response = await client.post("/run_code", json={"code": code, "language": language, **extra})
    assert response.status_code == 200
    body = response.json()
    assert_fusion_shape(body)
    assert body["status"] == status
    assert (body["compile_result"] or {}).get("status") == compile_status
    if run_status is None:
        assert body["run_result"] is None
        assert body["compile_result"]["return_code"] != 0
        assert "undeclared" in body["compile_result"]["stderr"]
    else:
        assert body["run_result"]["status"] == run_status
        assert body["run_result"]["return_code"] == return_code


async def test_run_code_ignores_unknown_fields_and_null_files_like_sandboxfusion(
    client: httpx.AsyncClient,
) -> None:
    request = {
        "code": "import os\nprint(sorted(os.listdir('.')))",
        "language": "python",
        "files": {"kept.txt": b64(b"x"), "skipped.txt": None},
        "some_future_field": True,
    }
    response = await client.post("/run_code", json=request)
    assert response.status_code == 200
    assert response.json()["run_result"]["stdout"] == "['kept.txt', 'main.py']\n"


async def test_run_code_fetches_absolute_paths_as_sandboxfusions_own_test_does(
    client: httpx.AsyncClient,
) -> None:
    # SandboxFusion's sandbox/tests/runners/test_python.py::test_python_fetch_files, field for field.
    request = {
        "language": "python",
        "code": 'open("a.txt", "w").write("secret"); open("/mnt/b", "w").write("sauce");',
        "run_timeout": 5,
        "fetch_files": ["a.txt", "/mnt/b"],
    }
    response = await client.post("/run_code", json=request)
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "Success"
    assert body["files"] == {"a.txt": b64(b"secret"), "/mnt/b": b64(b"sauce")}


async def test_run_code_uploads_to_absolute_paths_in_the_writable_roots(client: httpx.AsyncClient) -> None:
    code = (
        "import os\n"
        "print(open('/tmp/flag.txt').read(), open('/mnt/data/in.txt').read(), open('here.txt').read())\n"
        "open('/tmp/out/result.txt', 'w').write(str(sorted(os.listdir('.'))))"
    )
    request = {
        "code": code,
        "language": "python",
        "files": {
            "/tmp/flag.txt": b64(b"flag"),
            "/mnt/data/in.txt": b64(b"data"),
            "/workspace/here.txt": b64(b"here"),
            "/tmp/out/keep": b64(b""),
        },
        "fetch_files": ["/tmp/out/result.txt", "/workspace/here.txt", "/tmp/flag.txt"],
    }
    response = await client.post("/run_code", json=request)
    body = response.json()
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == "flag data here\n"
    assert body["files"] == {
        "/tmp/out/result.txt": b64(b"['here.txt', 'main.py']"),
        "/workspace/here.txt": b64(b"here"),
        "/tmp/flag.txt": b64(b"flag"),
    }


ESCAPING_PATHS = [
    "/etc/passwd",
    "/proc/self/environ",
    "/proc/1/root/etc/shadow",
    "/tmp/../etc/passwd",
    "/mnt/../../etc/passwd",
    "/workspace/../etc/passwd",
    "//tmp/x",
    "/.staging/x",
    "/.program/main.py",
    "/dev/null",
    "/tmp",
    "../x",
    "a/../../x",
]


@pytest.mark.parametrize(
    ("route", "field"),
    [("/run_code", "files"), ("/run_code", "fetch_files"), ("/v1/run", "files"), ("/v1/run", "collect")],
)
async def test_paths_that_would_escape_the_writable_roots_are_a_422_naming_them(
    client: httpx.AsyncClient, route: str, field: str
) -> None:
    for path in ESCAPING_PATHS:  # one pool for all of them: each is refused before a slot is taken
        body: dict[str, Any] = {"code": "print('NEVER_RUN')", "language": "python"}
        body[field] = {path: b64(b"x")} if field == "files" else [path]
        response = await client.post(route, json=body)
        assert response.status_code == 422, (path, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_path" and error["field"] == field, (path, error)
        assert repr(path) in error["message"] and "/tmp, /dev/shm, /mnt" in error["message"], (path, error)


async def test_session_files_go_to_and_come_from_absolute_paths(client: httpx.AsyncClient) -> None:
    session = (await client.post("/v1/sessions")).json()["id"]
    try:
        files = {"/tmp/in.txt": b64(b"one"), "/mnt/in.txt": b64(b"two")}
        assert (await client.put(f"/v1/sessions/{session}/files", json={"files": files})).status_code == 204
        run = await client.post(
            f"/v1/sessions/{session}/run",
            json={"code": "cat /tmp/in.txt /mnt/in.txt > /mnt/out.txt", "language": "bash"},
        )
        assert run.json()["status"] == "ok"
        got = await client.get(
            f"/v1/sessions/{session}/files", params={"path": ["/mnt/out.txt", "/tmp/in.txt"]}
        )
        assert got.json() == {"files": {"/mnt/out.txt": b64(b"onetwo"), "/tmp/in.txt": b64(b"one")}}
        escape = await client.get(f"/v1/sessions/{session}/files", params={"path": "/etc/passwd"})
        assert escape.status_code == 422 and "'/etc/passwd'" in escape.json()["error"]["message"]
    finally:
        await client.delete(f"/v1/sessions/{session}")


async def test_run_code_reports_the_pod_name_from_the_environment(
    pool: SandboxPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MY_POD_NAME", "sandbox-7")
    transport = httpx.ASGITransport(app=create_app(pool))
    async with httpx.AsyncClient(transport=transport, base_url="http://sandbox") as http:
        response = await http.post("/run_code", json={"code": "print(1)", "language": "python"})
    assert response.json()["executor_pod_name"] == "sandbox-7"


@pytest.mark.parametrize(
    ("result", "status", "compile_status", "run_status", "return_code", "message"),
    [
        (
            RunResult(status=RunStatus.SANDBOX_ERROR, error="worker w3 failed: EOF"),
            "SandboxError",
            None,
            "Error",
            None,
            "worker w3 failed: EOF",
        ),
        (
            RunResult(
                status=RunStatus.TIMEOUT,
                stage=RunStage.COMPILE,
                compile=CompileOutput(exit_code=None, stdout="", stderr="", wall_ms=10_000.0),
            ),
            "Failed",
            "TimeLimitExceeded",
            None,
            None,
            "",
        ),
        (
            RunResult(status=RunStatus.OUTPUT_LIMIT, signal=9, stdout="x" * 10, wall_ms=5.0),
            "Failed",
            None,
            "Finished",
            137,
            "",
        ),
        (
            RunResult(status=RunStatus.KILLED, signal=9, wall_ms=5.0),
            "Failed",
            None,
            "Finished",
            137,
            "",
        ),
    ],
    ids=["sandbox-error", "compile-timeout", "output-limit", "killed"],
)
def test_to_fusion_maps_rare_statuses_faithfully(
    result: RunResult,
    status: str,
    compile_status: str | None,
    run_status: str | None,
    return_code: int | None,
    message: str,
) -> None:
    answer = to_fusion(result, None)
    assert answer.status is FusionRunStatus(status)
    assert answer.message == message
    assert (answer.compile_result.status if answer.compile_result else None) == (
        FusionCommandStatus(compile_status) if compile_status else None
    )
    if run_status is None:
        assert answer.run_result is None
    else:
        assert answer.run_result is not None
        assert answer.run_result.status is FusionCommandStatus(run_status)
        assert answer.run_result.return_code == return_code


# ---- malformed requests --------------------------------------------------------------------------------

FUSION = {"code": "x", "language": "python"}
MALFORMED = [
    ("/v1/run", {"language": "python"}, 422, ["code", "missing"], "code"),
    ("/v1/run", {"code": 123}, 422, ["code", "123", "string"], "code"),
    ("/v1/run", {"code": "print(1)", "stdin": ["a"]}, 422, ["stdin"], "stdin"),
    ("/v1/run", {"code": "x", "language": "cobol"}, 422, ["'cobol'", "python", "cpp"], "language"),
    ("/v1/run", {"code": "x", "files": {"a.txt": "%%%"}}, 422, ["files['a.txt']", "base64"], "files.a.txt"),
    ("/v1/run", {"code": "x", "timeout": 5}, 422, ["unknown field 'timeout'"], "timeout"),
    ("/v1/run", {"code": "x", "spec": {"memory_mib": -1}}, 422, ["memory_mib = -1", "16"], "spec.memory_mib"),
    ("/v1/run", {"code": "x", "spec": {"gpus": 1}}, 422, ["unknown key 'gpus'"], "spec.gpus"),
    ("/v1/run", {"code": "x", "collect": ["../../etc/passwd"]}, 422, ["'../../etc/passwd'"], "collect"),
    ("/v1/run", {"code": "x", "files": {"/abs": b64(b"1")}}, 422, ["'/abs'", "relative"], "files"),
    ("/v1/sessions", {"spec": {"timeout_s": 0}}, 422, ["timeout_s", "0", "greater than 0"], "spec.timeout_s"),
    ("/run_code", {"language": "python"}, 422, ["code", "missing"], "code"),
    ("/run_code", {"code": "x", "language": "go"}, 422, ["'go'", "nodejs", "python"], "language"),
    ("/run_code", {**FUSION, "files": {"a": "@@"}}, 422, ["base64"], "files.a"),
    ("/run_code", {**FUSION, "run_timeout": "soon"}, 422, ["run_timeout"], "run_timeout"),
    ("/run_code", {**FUSION, "run_timeout": -1}, 422, ["run_timeout = -1"], "run_timeout"),
    ("/run_code", {**FUSION, "memory_limit_MB": 3}, 422, ["memory_limit_MB = 3"], "memory_limit_MB"),
    ("/run_code", {**FUSION, "fetch_files": ["/etc/passwd"]}, 422, ["'/etc/passwd'"], "fetch_files"),
    ("/run_code", [1, 2], 400, ["JSON object"], None),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "phrases", "field"),
    MALFORMED,
    ids=[f"{case[0]} {case[3][0]}" for case in MALFORMED],
)
async def test_malformed_request_is_a_4xx_naming_the_problem(
    client: httpx.AsyncClient, path: str, body: Any, status: int, phrases: list[str], field: str | None
) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "field"}
    for phrase in phrases:
        assert phrase in error["message"]
    if field is not None:
        assert error["field"] == field


@pytest.mark.parametrize("path", ["/v1/run", "/run_code", "/v1/sessions"])
async def test_body_that_is_not_json_is_a_400(client: httpx.AsyncClient, path: str) -> None:
    response = await client.post(path, content=b'{"code": ', headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_json"
    assert "not valid JSON" in response.json()["error"]["message"]


# ---- native API ----------------------------------------------------------------------------------------


async def test_native_run_returns_the_run_result_with_collected_files(client: httpx.AsyncClient) -> None:
    body = {
        "code": "import sys\ndata = open('in/data.bin', 'rb').read()\n"
        "open('out.bin', 'wb').write(data[::-1])\nprint(sys.stdin.read().upper())",
        "stdin": "shout",
        "files": {"in/data.bin": b64(b"\x00\x01\xff")},
        "collect": ["out.bin"],
    }
    response = await client.post("/v1/run", json=body)
    assert response.status_code == 200
    result = RunResult.model_validate(response.json())
    assert result.status is RunStatus.OK
    assert result.stdout == "SHOUT\n"
    assert result.files == {"out.bin": b64(b"\xff\x01\x00")}


async def test_native_run_applies_spec_overrides(client: httpx.AsyncClient) -> None:
    body = {"code": "import time\ntime.sleep(5)", "spec": {"timeout_s": 0.3}}
    response = await client.post("/v1/run", json=body)
    assert response.status_code == 200
    assert response.json()["status"] == "timeout"


async def test_session_keeps_files_across_runs_until_deleted(client: httpx.AsyncClient) -> None:
    created = await client.post("/v1/sessions", json={"spec": {"timeout_s": 5}})
    assert created.status_code == 201
    session = created.json()["id"]
    uploaded = await client.put(f"/v1/sessions/{session}/files", json={"files": {"notes/a.txt": b64(b"one")}})
    assert uploaded.status_code == 204
    first = await client.post(
        f"/v1/sessions/{session}/run",
        json={"code": "s = open('notes/a.txt').read()\nopen('b.txt', 'w').write(s + ' two')\nprint(s)"},
    )
    assert first.json()["stdout"] == "one\n"
    second = await client.post(f"/v1/sessions/{session}/run", json={"code": "cat b.txt", "language": "bash"})
    assert second.json()["stdout"] == "one two"
    downloaded = await client.get(f"/v1/sessions/{session}/files", params={"path": ["b.txt", "notes/a.txt"]})
    assert downloaded.json() == {"files": {"b.txt": b64(b"one two"), "notes/a.txt": b64(b"one")}}
    assert (await client.delete(f"/v1/sessions/{session}")).status_code == 204
    gone = await client.post(f"/v1/sessions/{session}/run", json={"code": "print(1)"})
    assert gone.status_code == 404
    assert session in gone.json()["error"]["message"]


async def test_download_of_a_missing_file_is_a_404_naming_it(client: httpx.AsyncClient) -> None:
    session = (await client.post("/v1/sessions")).json()["id"]
    try:
        response = await client.get(f"/v1/sessions/{session}/files", params={"path": "nowhere.txt"})
        assert response.status_code == 404
        assert "nowhere.txt" in response.json()["error"]["message"]
    finally:
        await client.delete(f"/v1/sessions/{session}")


@pytest.mark.parametrize(
    ("method", "suffix", "body"),
    [
        ("POST", "/run", {"code": "print(1)"}),
        ("PUT", "/files", {"files": {}}),
        ("GET", "/files?path=a.txt", None),
        ("DELETE", "", None),
    ],
)
async def test_unknown_session_is_a_404(
    client: httpx.AsyncClient, method: str, suffix: str, body: dict[str, Any] | None
) -> None:
    response = await client.request(method, f"/v1/sessions/s0000000000000000{suffix}", json=body)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "session_not_found"
    assert "s0000000000000000" in response.json()["error"]["message"]


async def test_concurrent_runs_in_one_session_are_serialized(client: httpx.AsyncClient) -> None:
    session = (await client.post("/v1/sessions")).json()["id"]
    try:
        code = "import os\nwith open('log', 'a') as f: f.write(os.environ['N'])\nprint(open('log').read())"
        runs = [
            client.post(f"/v1/sessions/{session}/run", json={"code": code, "spec": {"env": {"N": str(n)}}})
            for n in range(4)
        ]
        answers = await asyncio.gather(*runs)
        assert all(answer.json()["status"] == "ok" for answer in answers)
        final = await client.get(f"/v1/sessions/{session}/files", params={"path": "log"})
        assert sorted(base64.b64decode(final.json()["files"]["log"]).decode()) == ["0", "1", "2", "3"]
    finally:
        await client.delete(f"/v1/sessions/{session}")


# ---- health and metrics --------------------------------------------------------------------------------


async def test_healthz_is_200_when_a_trivial_run_passes(client: httpx.AsyncClient) -> None:
    response = await client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "slots": 2, "open_sessions": 0, "running": 0, "queue_depth": 0}


async def test_healthz_is_503_full_at_once_when_open_sessions_hold_every_slot(pool: SandboxPool) -> None:
    transport = httpx.ASGITransport(app=create_app(pool, health_timeout_s=30))
    async with httpx.AsyncClient(transport=transport, base_url="http://sandbox") as http:
        sessions = [(await http.post("/v1/sessions")).json()["id"] for _ in range(pool.config.slots)]
        try:
            response = await asyncio.wait_for(http.get("/healthz"), 5)  # not the 30 s health timeout
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert response.json()["status"] == "full"
            assert "2 of 2 slots held by open sessions" in response.json()["reasons"][0]
            assert response.json()["open_sessions"] == response.json()["slots"] == 2
        finally:
            for session in sessions:
                await http.delete(f"/v1/sessions/{session}")
        assert (await http.get("/healthz")).status_code == 200
        assert pool.queue_depth == 0 and pool.busy_slots == 0


async def test_healthz_is_503_when_no_slot_frees_up_in_time(pool: SandboxPool) -> None:
    transport = httpx.ASGITransport(app=create_app(pool, health_timeout_s=0.3))
    async with httpx.AsyncClient(transport=transport, base_url="http://sandbox") as http:
        runs = [
            asyncio.create_task(http.post("/v1/run", json={"code": "import time; time.sleep(2)"}))
            for _ in range(pool.config.slots)
        ]
        while pool.busy_slots < pool.config.slots:
            await asyncio.sleep(0.02)
        response = await http.get("/healthz")
        assert response.status_code == 503
        assert response.json()["status"] == "unhealthy"
        assert "0.3 s" in response.json()["reasons"][0]
        assert response.json()["running"] == response.json()["slots"] == 2
        finished = [await run for run in runs]
        assert [run.json()["status"] for run in finished] == ["ok"] * len(runs)
        assert (await http.get("/healthz")).status_code == 200


async def test_session_open_with_every_slot_held_by_sessions_is_a_503_with_retry_after() -> None:
    config = PoolConfig(slots=1, session_wait_s=0.3)
    async with SandboxPool(SandboxSpec(timeout_s=5), config) as pool:
        transport = httpx.ASGITransport(app=create_app(pool))
        async with httpx.AsyncClient(transport=transport, base_url="http://sandbox") as http:
            held = (await http.post("/v1/sessions")).json()["id"]
            started = time.monotonic()
            refused = await asyncio.wait_for(http.post("/v1/sessions"), 5)
            waited = time.monotonic() - started
            started = time.monotonic()
            health_response = await asyncio.wait_for(http.get("/healthz"), 5)
            health_s = time.monotonic() - started
            health = health_response.json()
            text = (await http.get("/metrics")).text
            await http.delete(f"/v1/sessions/{held}")
            reopened = await asyncio.wait_for(http.post("/v1/sessions"), 5)
            await http.delete(f"/v1/sessions/{reopened.json()['id']}")
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert 0.3 <= waited < 2
    error = refused.json()["error"]
    assert error["type"] == "no_free_slot"
    assert "within 0.3 s" in error["message"] and "1 of 1 slots held by open sessions" in error["message"]
    assert health["open_sessions"] == health["slots"] == 1
    # the health run would wait for a slot only a session's close frees: answered at once instead
    assert health_response.status_code == 503 and health["status"] == "full" and health_s < 2
    assert health_response.headers["retry-after"] == "1"
    assert metric(text, "tether_sandbox_open_sessions") == 1
    assert metric(text, "tether_sandbox_sessions_refused_total") == 1
    assert reopened.status_code == 201
    assert pool.queue_depth == 0


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


async def test_metrics_count_runs_by_language_and_status(pool: SandboxPool) -> None:
    transport = httpx.ASGITransport(app=create_app(pool))
    async with httpx.AsyncClient(transport=transport, base_url="http://sandbox") as http:
        await http.post("/v1/run", json={"code": "print(1)"})
        await http.post("/v1/run", json={"code": "raise SystemExit(1)"})
        await http.post("/run_code", json={"code": "echo hi", "language": "bash"})
        response = await http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert metric(text, 'tether_sandbox_runs_total{language="python",status="ok"}') == 1
    assert metric(text, 'tether_sandbox_runs_total{language="python",status="runtime_error"}') == 1
    assert metric(text, 'tether_sandbox_runs_total{language="bash",status="ok"}') == 1
    assert metric(text, 'tether_sandbox_run_seconds_count{language="python"}') == 2
    assert metric(text, "tether_sandbox_slots") == pool.config.slots
    assert metric(text, "tether_sandbox_qc_failures_total") == pool.qc_failures
    assert metric(text, "tether_sandbox_workers_replaced_total") == pool.workers_replaced


async def test_metrics_registry_belongs_to_each_app(pool: SandboxPool) -> None:
    first, second = create_app(pool), create_app(pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=first), base_url="http://a") as http:
        await http.post("/v1/run", json={"code": "print(1)"})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=second), base_url="http://b") as http:
        text = (await http.get("/metrics")).text
    assert "tether_sandbox_runs_total{" not in text


async def test_metrics_show_queue_depth_and_busy_slots(pool: SandboxPool) -> None:
    transport = httpx.ASGITransport(app=create_app(pool))
    async with httpx.AsyncClient(transport=transport, base_url="http://sandbox") as http:
        sessions = [(await http.post("/v1/sessions")).json()["id"] for _ in range(pool.config.slots)]
        queued = asyncio.ensure_future(http.post("/v1/run", json={"code": "print('queued')"}))
        for _ in range(100):
            if pool.queue_depth:
                break
            await asyncio.sleep(0.01)
        text = (await http.get("/metrics")).text
        assert metric(text, "tether_sandbox_queue_depth") == 1
        assert metric(text, "tether_sandbox_busy_slots") == pool.config.slots
        assert metric(text, "tether_sandbox_open_sessions") == pool.config.slots
        for session in sessions:
            await http.delete(f"/v1/sessions/{session}")
        assert (await queued).json()["stdout"] == "queued\n"
        assert metric((await http.get("/metrics")).text, "tether_sandbox_queue_depth") == 0
