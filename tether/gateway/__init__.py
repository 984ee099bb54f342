"""The API gateway: tenants and keys, tiered token pricing, quotas and rate limits, a usage ledger."""

from tether.gateway.app import Gateway, create_gateway_app
from tether.gateway.config import GatewayConfig, Limits, Pool, Price, Tier, load_gateway_config
from tether.gateway.keys import ApiKey, KeyStore
from tether.gateway.ledger import Ledger
from tether.gateway.limits import LimitStore, MemoryLimitStore
from tether.gateway.pricing import Usage, cost_usd
from tether.gateway.redis_limits import RedisLimitStore
from tether.gateway.runtime import build_gateway, running_gateway, serve_gateway
from tether.gateway.upstream import HttpUpstream, Upstream, UpstreamError

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
