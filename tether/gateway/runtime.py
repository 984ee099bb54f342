"""Wiring: the stores, limit back end and upstream client a `Gateway` needs, from one `GatewayConfig`, and
serving it with uvicorn. Everything opened here is closed here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx2

from tether.gateway.app import Gateway, create_gateway_app
from tether.gateway.config import GatewayConfig
from tether.gateway.keys import KeyStore
from tether.gateway.ledger import Ledger
from tether.gateway.limits import LimitStore, MemoryLimitStore
from tether.gateway.redis_limits import RedisLimitStore
from tether.store import make_engine


def open_stores(config: GatewayConfig) -> tuple[KeyStore, Ledger]:
    if config.ledger_url.startswith("sqlite:///"):
        Path(config.ledger_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = make_engine(config.ledger_url)
    return KeyStore(engine, config.table_prefix), Ledger(engine, config.table_prefix)


def open_limits(config: GatewayConfig) -> LimitStore:
    if config.redis_url is None:
        return MemoryLimitStore()
    return RedisLimitStore(config.redis_url, config.redis_prefix)


def build_gateway(
    config: GatewayConfig,
    transport: httpx2.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.time,
) -> Gateway:
    """A gateway with its stores, limits and one pooled upstream client (`transport` replaces the
    network). Nothing connects until first used, so it may be built outside the loop that serves it."""
    keys, ledger = open_stores(config)
    # httpx2 (httpx's successor, same API): httpx 0.28's connection pool rescans and probes every pooled
    # socket on each request, which capped the gateway near 100 requests/s at 32 concurrent clients
    connections = sum(pool.max_in_flight for pool in config.pools.values())
    client = httpx2.AsyncClient(
        transport=transport,
        timeout=httpx2.Timeout(config.upstream_timeout_s, connect=10.0),
        limits=httpx2.Limits(max_connections=connections, max_keepalive_connections=connections),
    )
    return Gateway(config, keys, ledger, open_limits(config), client, clock)


@asynccontextmanager
async def running_gateway(
    config: GatewayConfig,
    transport: httpx2.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.time,
) -> AsyncIterator[Gateway]:
    gateway = build_gateway(config, transport, clock)
    try:
        yield gateway
    finally:
        await gateway.aclose()


def serve_gateway(config: GatewayConfig, host: str, port: int, log_level: str = "info") -> None:
    import uvicorn

    async def main() -> None:
        async with running_gateway(config) as gateway:
            # per-request access lines would cost more than the gateway's own work; metrics count requests
            app = create_gateway_app(gateway)
            server = uvicorn.Server(
                uvicorn.Config(
                    app, host=host, port=port, log_level=log_level, access_log=log_level == "debug"
                )
            )
            await server.serve()

    asyncio.run(main())
