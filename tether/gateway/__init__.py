"""The API gateway: tenants and keys, tiered token pricing, quotas and rate limits, a usage ledger.

The public names are loaded on first use, so that reading the gateway's config (`tether gateway keys`)
does not import the server, its Redis client and telemetry.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tether.chat.completion import Usage
    from tether.chat.pricing import Price, Tier, cost_usd
    from tether.gateway.app import create_gateway_app
    from tether.gateway.config import GatewayConfig, Limits, Pool, load_gateway_config
    from tether.gateway.handling import Gateway
    from tether.gateway.keys import ApiKey, KeyStore
    from tether.gateway.ledger import Ledger
    from tether.gateway.limits import LimitStore, MemoryLimitStore
    from tether.gateway.redis_limits import RedisLimitStore
    from tether.gateway.runtime import build_gateway, running_gateway, serve_gateway
    from tether.gateway.upstream import HttpUpstream, Upstream, UpstreamError

_EXPORTS = {
    "ApiKey": "tether.gateway.keys",
    "Gateway": "tether.gateway.handling",
    "GatewayConfig": "tether.gateway.config",
    "HttpUpstream": "tether.gateway.upstream",
    "KeyStore": "tether.gateway.keys",
    "Ledger": "tether.gateway.ledger",
    "LimitStore": "tether.gateway.limits",
    "Limits": "tether.gateway.config",
    "MemoryLimitStore": "tether.gateway.limits",
    "Pool": "tether.gateway.config",
    "Price": "tether.chat.pricing",
    "RedisLimitStore": "tether.gateway.redis_limits",
    "Tier": "tether.chat.pricing",
    "Upstream": "tether.gateway.upstream",
    "UpstreamError": "tether.gateway.upstream",
    "Usage": "tether.chat.completion",
    "build_gateway": "tether.gateway.runtime",
    "cost_usd": "tether.chat.pricing",
    "create_gateway_app": "tether.gateway.app",
    "load_gateway_config": "tether.gateway.config",
    "running_gateway": "tether.gateway.runtime",
    "serve_gateway": "tether.gateway.runtime",
}

__all__ = [
    "ApiKey",
    "Gateway",
    "GatewayConfig",
    "HttpUpstream",
    "KeyStore",
    "Ledger",
    "LimitStore",
    "Limits",
    "MemoryLimitStore",
    "Pool",
    "Price",
    "RedisLimitStore",
    "Tier",
    "Upstream",
    "UpstreamError",
    "Usage",
    "build_gateway",
    "cost_usd",
    "create_gateway_app",
    "load_gateway_config",
    "running_gateway",
    "serve_gateway",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tether.gateway' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
