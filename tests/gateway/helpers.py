"""A gateway in front of an engine URL, served in-process to httpx/openai clients through ASGI."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx
import openai

from tether.chat import Usage
from tether.gateway import Gateway, GatewayConfig, Limits, Tier, build_gateway, create_gateway_app

from .conftest import drop_tables


@dataclass
class Served:
    gateway: Gateway
    http: httpx.AsyncClient

    def key(self, tenant: str = "acme", tier: Tier = Tier.STANDARD, **limits: object) -> str:
        secret, _ = self.gateway.keys.create(tenant, tier, Limits.model_validate(limits))
        return secret

    def openai(self, secret: str) -> openai.AsyncOpenAI:
        # openai's stubs name its vendored httpx; the real httpx client works the same at runtime
        http: Any = self.http
        return openai.AsyncOpenAI(
            base_url="http://gateway/v1", api_key=secret, http_client=http, max_retries=0
        )


@asynccontextmanager
async def serve(config: GatewayConfig) -> AsyncIterator[Served]:
    gateway = build_gateway(config)
    transport = httpx.ASGITransport(app=create_gateway_app(gateway))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=120) as http:
        try:
            yield Served(gateway, http)
        finally:
            await gateway.aclose()
            drop_tables(config)


def expected_cost(usage: Usage, tier: Tier) -> Decimal:
    """The price list applied by hand: the test's own arithmetic, not the gateway's."""
    factor = 2 if tier is Tier.FAST else 1
    missed = usage.prompt_tokens - usage.cached_tokens
    micro = (
        usage.cached_tokens * Decimal("0.18")
        + missed * Decimal("1.80")
        + usage.completion_tokens * Decimal("9.50")
    )
    return factor * micro / Decimal(1_000_000)
