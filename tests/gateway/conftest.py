"""Gateway fixtures: a real engine server (tiny random Qwen3, or SmolLM2 for slow tests) on a local port,
ledger back ends (SQLite file, PostgreSQL tables with a unique prefix), Redis prefixes, live servers."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from tests.live_server import live_server
from tether.engine.async_engine import AsyncEngine, AsyncEngineConfig
from tether.engine.llm_engine import LLMEngine
from tether.gateway import Gateway, GatewayConfig, Pool, build_gateway, create_gateway_app
from tether.serving.app import create_app
from tether.testing import make_tiny_model

POSTGRES_URL = os.environ.get("TETHER_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TETHER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
TINY = "tiny-qwen3"
LEDGERS = ["sqlite", pytest.param("postgres", marks=pytest.mark.services)]


def skip_without_services() -> None:
    if os.environ.get("TETHER_NO_SERVICES") == "1":
        pytest.skip("TETHER_NO_SERVICES=1: PostgreSQL/Redis are not available")


def unique_prefix() -> str:
    return f"gw{uuid.uuid4().hex[:10]}_"


@contextmanager
def engine_server(path: Path, name: str, **engine_options: Any) -> Iterator[str]:
    engine, tokenizer = LLMEngine.from_pretrained(path, **engine_options)
    async_engine = AsyncEngine(engine, AsyncEngineConfig())
    async_engine.start()
    try:
        with live_server(create_app(async_engine, tokenizer, name)) as url:
            yield url
    finally:
        async_engine.shutdown()


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_engine_url(tiny_path: Path) -> Iterator[str]:
    with engine_server(tiny_path, TINY, kv_cache_mib=4, max_model_len=256) as url:
        yield url


@pytest.fixture(params=LEDGERS)
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    skip_without_services()
    return POSTGRES_URL


def make_config(upstream: str, ledger_url: str, model: str = TINY, **fields: Any) -> GatewayConfig:
    pool = fields.pop("pool", {})
    return GatewayConfig.model_validate(
        {
            "models": {model: "engine"},
            "pools": {"engine": Pool(urls=[upstream], **pool)},
            "ledger_url": ledger_url,
            "table_prefix": unique_prefix(),
            "key_cache_s": 0,
            **fields,
        }
    )


def drop_tables(config: GatewayConfig) -> None:
    """PostgreSQL tables outlive the test; SQLite files go with tmp_path."""
    if config.ledger_url.startswith("postgresql"):
        from tether.gateway.runtime import open_stores

        keys, ledger = open_stores(config)
        ledger.drop()
        keys.drop()
        keys.engine.dispose()


@contextmanager
def live_gateway(config: GatewayConfig) -> Iterator[tuple[str, Gateway]]:
    """A gateway built, served by uvicorn and closed inside one background thread's event loop."""
    holder: dict[str, Any] = {}
    ready = threading.Event()

    async def main() -> None:
        gateway = build_gateway(config)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(create_gateway_app(gateway), log_level="warning"))
        holder.update(gateway=gateway, server=server, url=f"http://127.0.0.1:{sock.getsockname()[1]}")
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        ready.set()
        try:
            await serving
        finally:
            await gateway.aclose()
            sock.close()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the gateway did not start"
    try:
        yield holder["url"], holder["gateway"]
    finally:
        holder["server"].should_exit = True
        thread.join(10)
        drop_tables(config)
