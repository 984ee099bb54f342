"""50 clients hammer one key with a 10,000-token window, through one gateway (in-process limits) or two
gateway instances sharing Redis: the ledger never exceeds the window and equals the sum of the requests
each client saw succeed."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from tether.gateway import Limits, Tier, build_gateway, create_gateway_app
from tether.gateway.redis_limits import RedisLimitStore

from .conftest import POSTGRES_URL, REDIS_URL, TINY, drop_tables, make_config, skip_without_services

CLIENTS = 50
REQUESTS_PER_CLIENT = 3
WINDOW_TOKENS = 10_000
PROMPT_BYTES = 100  # the tiny tokenizer has one token per byte: each request uses 100 + 4 tokens


@pytest.mark.parametrize(
    "setup", ["one-instance", pytest.param("two-instances-redis", marks=pytest.mark.services)]
)
async def test_fifty_clients_never_exceed_the_token_window(
    setup: str, tiny_engine_url: str, tmp_path: object
) -> None:
    shared = setup != "one-instance"
    if shared:
        skip_without_services()
    ledger_url = POSTGRES_URL if shared else f"sqlite:///{tmp_path}/ledger.db"
    redis_prefix = f"test:{uuid.uuid4().hex}:"
    config = make_config(
        tiny_engine_url,
        ledger_url,
        redis_url=REDIS_URL if shared else None,
        redis_prefix=redis_prefix,
        pool={"max_in_flight": 16, "max_queued": 256},
    )
    instances = [build_gateway(config) for _ in range(2 if shared else 1)]
    secret, _ = instances[0].keys.create("acme", Tier.STANDARD, Limits(tokens_per_window=WINDOW_TOKENS))
    clients = [
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_gateway_app(g)), base_url="http://gw", timeout=120
        )
        for g in instances
    ]
    statuses: list[int] = []
    seen_tokens: list[int] = []
    codes: set[str] = set()

    async def hammer(client_no: int, requests: int = REQUESTS_PER_CLIENT) -> None:
        http = clients[client_no % len(clients)]
        for _ in range(requests):
            prompt = uuid.uuid4().hex.ljust(PROMPT_BYTES, ".")
            response = await http.post(
                "/v1/completions",
                json={"model": TINY, "prompt": prompt, "max_tokens": 4, "ignore_eos": True},
                headers={"Authorization": f"Bearer {secret}"},
            )
            statuses.append(response.status_code)
            if response.status_code == 200:
                seen_tokens.append(response.json()["usage"]["total_tokens"])
            else:
                codes.add(response.json()["error"]["code"])

    try:
        await asyncio.gather(*(hammer(i) for i in range(CLIENTS)))
        assert 429 in statuses
        while statuses[-1] == 200 or len(statuses) == CLIENTS * REQUESTS_PER_CLIENT:  # fill the rest alone
            for gateway in instances:  # settled reservations: the window holds only actual usage
                await gateway.flush()
            await hammer(len(statuses), requests=1)
        for gateway in instances:
            await gateway.flush()
        rows = instances[0].ledger.report("acme", since=0)
        ledger_tokens = sum(r.prompt_tokens + r.completion_tokens for r in rows)
        ledger_requests = sum(r.requests for r in rows)
        assert set(statuses) == {200, 429} and codes == {"tokens_limit_exceeded"}
        assert ledger_tokens <= WINDOW_TOKENS
        assert ledger_tokens == sum(seen_tokens) and ledger_requests == len(seen_tokens)
        # the window is full: with nothing in flight, one more reservation did not fit
        assert ledger_tokens > WINDOW_TOKENS - (64 + PROMPT_BYTES + 4)
        assert all(tokens == PROMPT_BYTES + 4 for tokens in seen_tokens)
    finally:
        for client in clients:
            await client.aclose()
        for gateway in instances:
            await gateway.aclose()
        if shared:
            cleanup = RedisLimitStore(REDIS_URL, redis_prefix)
            await cleanup.delete_prefix()
            await cleanup.close()
        drop_tables(config)
