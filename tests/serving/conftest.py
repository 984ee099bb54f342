"""The served app on a tiny random Qwen3, shared by the serving tests: in process (httpx's ASGI transport)
and behind a real uvicorn socket; request builders and an SSE reader."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from tests.live_server import live_server
from tether.engine.async_engine import AsyncEngine
from tether.engine.llm_engine import LLMEngine
from tether.serving.app import create_app
from tether.testing import make_tiny_model

MODEL = "tiny-qwen3"
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen3", seed=0)


@pytest.fixture(scope="module")
def served(tiny_path: Path) -> Iterator[tuple[AsyncEngine, FastAPI]]:
    engine, tokenizer = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=4, max_model_len=256)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    yield async_engine, create_app(async_engine, tokenizer, MODEL)
    async_engine.shutdown()


@pytest.fixture(scope="session")
def smollm2_url(smollm2_folder: Path) -> Iterator[str]:
    """The real SmolLM2 served as `smollm2-135m-instruct` behind a real socket: the `/v1` base URL."""
    engine, tokenizer = LLMEngine.from_pretrained(smollm2_folder, kv_cache_mib=192, max_model_len=2048)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        with live_server(create_app(async_engine, tokenizer, "smollm2-135m-instruct")) as address:
            yield f"{address}/v1"
    finally:
        async_engine.shutdown()


@pytest.fixture
async def client(served: tuple[AsyncEngine, FastAPI]) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=served[1])
    async with httpx.AsyncClient(transport=transport, base_url="http://tether", timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def live_url(served: tuple[AsyncEngine, FastAPI]) -> Iterator[str]:
    """The same app behind a real uvicorn on a free local port, in a background thread."""
    with live_server(served[1]) as url:
        yield url


def sse_events(text: str) -> list[Any]:
    lines = [line for line in text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines), text
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def aborted_count(app: FastAPI) -> float:
    value = app.state.server.metrics.registry.get_sample_value("tether_requests_total", {"status": "aborted"})
    return float(value or 0)


def chat(content: str = "hello", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **fields}


def text(prompt: str | list[int] = "hello", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, **fields}


def send_sync(app: FastAPI, path: str, content: bytes, method: str = "POST") -> httpx.Response:
    """One request of a JSON body, from a synchronous test (hypothesis runs its examples synchronously)."""

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tether", timeout=60) as client:
            headers = {"content-type": "application/json"}
            return await client.request(method, path, content=content, headers=headers)

    return asyncio.run(send())
