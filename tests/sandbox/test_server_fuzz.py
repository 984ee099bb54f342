"""Fuzzing every route of the sandbox server: broken bodies get a 4xx JSON error, never a 5xx.

Bodies are valid examples with fields replaced by arbitrary JSON (lone surrogates included), dropped or
added (`tests/fuzz.py`); the server runs over a real pool, so a body that happens to stay valid runs.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote_from_bytes

import httpx
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz import assert_client_error_or_success, deeply_nested, encode, mutated_bodies
from tether.sandbox import SandboxPool
from tether.sandbox.server import create_app

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
FILES = {"data/in.txt": base64.b64encode(b"1 2").decode()}
RUN = {"code": "print(open('data/in.txt').read())", "language": "python", "stdin": "", "files": FILES}
NATIVE = {**RUN, "collect": ["data/in.txt"], "spec": {"timeout_s": 5}}
EXAMPLES: dict[str, dict[str, Any]] = {
    "POST /run_code": {**RUN, "run_timeout": 5, "memory_limit_MB": -1, "fetch_files": ["data/in.txt"]},
    "POST /v1/run": {**NATIVE, "warm": True, "client": "fuzz"},
    "POST /v1/sessions": {"spec": {"timeout_s": 5, "env": {"A": "1"}}},
    "POST /v1/sessions/{id}/run": NATIVE,
    "PUT /v1/sessions/{id}/files": {"files": FILES},
}


@pytest_asyncio.fixture
async def client(pool: SandboxPool) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(pool))
    async with httpx.AsyncClient(transport=transport, base_url="http://sandbox", timeout=60) as http:
        yield http


@pytest_asyncio.fixture
async def session(client: httpx.AsyncClient) -> AsyncIterator[str]:
    """One open session for the session routes, and the sessions a fuzzed `POST /v1/sessions` opened."""
    opened = await client.post("/v1/sessions")
    assert opened.status_code == 201
    yield opened.json()["id"]
    await client.delete(f"/v1/sessions/{opened.json()['id']}")


async def send(client: httpx.AsyncClient, route: str, session: str, content: bytes) -> httpx.Response:
    method, path = route.split(" ", 1)
    response = await client.request(
        method,
        path.replace("{id}", session),
        content=content,
        headers={"content-type": "application/json"},
    )
    if path == "/v1/sessions" and response.status_code == 201:
        await client.delete(f"/v1/sessions/{response.json()['id']}")  # give the slot back at once
    return response


@pytest.mark.parametrize("route", sorted(EXAMPLES))
@FUZZ
@given(data=st.data())
async def test_fuzzed_body_is_answered_with_success_or_a_client_error(
    client: httpx.AsyncClient, session: str, route: str, data: st.DataObject
) -> None:
    body = data.draw(mutated_bodies(EXAMPLES[route]), label="body")
    response = await send(client, route, session, encode(body))
    assert_client_error_or_success(response.status_code, response.content, route=route)


BAD_TEXT = "print(1) \ud800"


def with_bad_text(example: dict[str, Any], name: str) -> dict[str, Any]:
    """`example` with a lone surrogate in its text field `name` (in a file name, path or env value)."""
    body = json.loads(json.dumps(example))
    if name == "files":
        body["files"] = {f"data/{BAD_TEXT}.txt": FILES["data/in.txt"]}
    elif name in ("collect", "fetch_files"):
        body[name] = [f"out{BAD_TEXT}.txt"]
    elif name == "spec":
        body["spec"] = {"env": {"GREETING": BAD_TEXT}}
    else:
        body[name] = BAD_TEXT
    return body


TEXT_FIELDS = ("code", "stdin", "language", "files", "collect", "fetch_files", "spec")
BAD_TEXT_CASES = [
    (route, name) for route, example in EXAMPLES.items() for name in TEXT_FIELDS if name in example
]


@pytest.mark.parametrize(("route", "name"), BAD_TEXT_CASES, ids=[" ".join(case) for case in BAD_TEXT_CASES])
async def test_lone_surrogate_in_any_text_is_a_400_naming_the_field(
    client: httpx.AsyncClient, session: str, route: str, name: str
) -> None:
    response = await send(client, route, session, encode(with_bad_text(EXAMPLES[route], name)))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_text"
    assert "surrogate" in error["message"] and "\\ud800" in error["message"]
    assert error["field"].split(".")[0] == name


@pytest.mark.parametrize("route", sorted(EXAMPLES))
async def test_deeply_nested_body_is_a_400(client: httpx.AsyncClient, session: str, route: str) -> None:
    response = await send(client, route, session, deeply_nested(100_000))
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["type"] == "invalid_json"


@FUZZ
@given(paths=st.lists(st.binary(max_size=24), min_size=1, max_size=3))
async def test_fuzzed_download_paths_are_answered_with_success_or_a_client_error(
    client: httpx.AsyncClient, session: str, paths: list[bytes]
) -> None:
    query = "&".join(f"path={quote_from_bytes(path, safe='')}" for path in paths)
    response = await client.get(f"/v1/sessions/{session}/files?{query}")
    assert_client_error_or_success(
        response.status_code, response.content, route="GET /v1/sessions/{id}/files"
    )
