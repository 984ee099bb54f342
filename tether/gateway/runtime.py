"""Wiring: the stores, limit back end and upstream client a `Gateway` needs, from one `GatewayConfig`, and
serving it with uvicorn. Everything opened here is closed here."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.types import ASGIApp

from tether.gateway.app import create_gateway_app
from tether.gateway.config import GatewayConfig
from tether.gateway.handling import Gateway
from tether.gateway.keys import KeyStore
from tether.gateway.ledger import Ledger
from tether.gateway.limits import LimitStore, MemoryLimitStore, entries_from_ledger, longest_window_s
from tether.gateway.redis_limits import RedisLimitStore
from tether.gateway.upstream import HttpUpstream, Upstream
from tether.store import make_engine


def open_stores(config: GatewayConfig) -> tuple[KeyStore, Ledger]:
    if config.ledger_url.startswith("sqlite:///"):
        Path(config.ledger_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = make_engine(config.ledger_url)
    return KeyStore(engine, config.table_prefix), Ledger(engine, config.table_prefix)


def open_limits(config: GatewayConfig, keys: KeyStore, ledger: Ledger, now: float) -> LimitStore:
    """Redis keeps shared counters across restarts; in-process ones are rebuilt from the ledger: its
    charges at their cost, and the reservations no charge ended (requests a crash cut short) at their
    worst case, so that no budget can be overshot across restarts."""
    if config.redis_url is not None:
        return RedisLimitStore(config.redis_url, config.redis_prefix)
    store = MemoryLimitStore()
    key_limits = {key.key_id: key.limits for key in keys.list()}
    tenant_limits = [*config.tenant_limits.values(), config.default_tenant_limits]
    window_s = longest_window_s([*key_limits.values(), *tenant_limits])
    if window_s > 0:
        usage = ledger.recent_usage(now - window_s) + ledger.open_reservations(now - window_s)
        store.seed(entries_from_ledger(usage, key_limits, config.tenant, now))
    return store


def build_gateway(
    config: GatewayConfig,
    upstream: Upstream | None = None,
    clock: Callable[[], float] = time.time,
) -> Gateway:
    """A gateway with its stores, limits and one pooled upstream client (`upstream` replaces it). Nothing
    connects until first used, so it may be built outside the loop that serves it."""
    keys, ledger = open_stores(config)
    if upstream is None:
        idle = max(pool.max_in_flight for pool in config.pools.values())
        upstream = HttpUpstream(config.upstream_timeout_s, max_idle=idle)
    return Gateway(config, keys, ledger, open_limits(config, keys, ledger, clock()), upstream, clock)


@asynccontextmanager
async def running_gateway(
    config: GatewayConfig,
    upstream: Upstream | None = None,
    clock: Callable[[], float] = time.time,
) -> AsyncIterator[Gateway]:
    gateway = build_gateway(config, upstream, clock)
    gateway.start()
    try:
        yield gateway
    finally:
        await gateway.aclose()


def serve_gateway(
    config: GatewayConfig,
    host: str,
    port: int,
    log_level: str = "info",
    mounts: Mapping[str, ASGIApp] | None = None,
) -> None:
    """Serve until interrupted; `mounts` are other ASGI apps served under their paths (the console)."""
    import uvicorn

    async def main() -> None:
        async with running_gateway(config) as gateway:
            # per-request access lines would cost more than the gateway's own work; metrics count requests
            app = create_gateway_app(gateway)
            for path, mounted in (mounts or {}).items():
                app.mount(path, mounted)
            # the ~100k objects of the imported libraries live as long as the process: frozen, they are
            # left out of full collections, which otherwise stalled a request for 100-200 ms now and then
            gc.collect()
            gc.freeze()
            server = uvicorn.Server(
                uvicorn.Config(
                    app, host=host, port=port, log_level=log_level, access_log=log_level == "debug"
                )
            )
            await server.serve()

    asyncio.run(main())
