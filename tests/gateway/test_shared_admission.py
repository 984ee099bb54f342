"""Two in-process gateways sharing a pool limit of N through Redis never have more than N requests at the
upstream together (each alone would send N, together 2N), and an unreachable Redis is a 503 with
Retry-After naming it, or the local limit when `on_store_down = "local"`."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.live_server import free_port
from tether.gateway import GatewayConfig, Limits, Tier, build_gateway, create_gateway_app
from tether.gateway.config import SharedAdmission, StoreDown
from tether.gateway.upstream import Target

from .conftest import POSTGRES_URL, REDIS_URL, drop_tables, make_config, skip_without_services
from .test_admission import delete_keys

pytestmark = pytest.mark.services

MODEL = "fake"
N = 3


class _Answer:
    status_code = 200

    def __init__(self, upstream: CountingUpstream) -> None:
        self.upstream, self.open = upstream, True

    async def aread(self) -> bytes:
        await asyncio.sleep(0.03)
        usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
        choice = {"index": 0, "text": "ok", "finish_reason": "length"}
        return json.dumps(
            {"id": "c", "object": "text_completion", "choices": [choice], "usage": usage}
        ).encode()

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        yield await self.aread()

    async def aclose(self) -> None:
        if self.open:
            self.open = False
            self.upstream.running -= 1


class CountingUpstream:
    """An engine pool that answers after 30 ms and counts the requests it holds at once."""

    def __init__(self) -> None:
        self.running = self.peak = self.served = 0

    async def post(self, target: Target, body: bytes) -> _Answer:
        self.running += 1
        self.served += 1
        self.peak = max(self.peak, self.running)
        return _Answer(self)

    async def aclose(self) -> None:
        pass


async def fire(config: GatewayConfig, instances: int, requests: int) -> tuple[CountingUpstream, list[Any]]:
    """`requests` concurrent completions spread over `instances` gateways on one upstream; their responses."""
    upstream = CountingUpstream()
    gateways = [build_gateway(config, upstream) for _ in range(instances)]
    secret, _ = gateways[0].keys.create("acme", Tier.STANDARD, Limits())
    clients = [
        httpx.AsyncClient(transport=httpx.ASGITransport(app=create_gateway_app(g)), base_url="http://gw")
        for g in gateways
    ]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    headers = {"Authorization": f"Bearer {secret}"}
    try:
        responses = await asyncio.gather(
            *(
                clients[i % instances].post("/v1/completions", json=body, headers=headers)
                for i in range(requests)
            )
        )
    finally:
        for client in clients:
            await client.aclose()
        for gateway in gateways:
            await gateway.aclose()
        drop_tables(config)
    return upstream, list(responses)


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    skip_without_services()
    prefix = f"test:{uuid.uuid4().hex}:"
    yield prefix
    await delete_keys(prefix)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-in-redis", "per-instance"])
async def test_two_gateways_sharing_a_pool_limit_never_send_more_than_it(prefix: str, shared: bool) -> None:
    admission = SharedAdmission(url=REDIS_URL, prefix=prefix) if shared else None
    config = make_config(
        "http://engine:1",
        POSTGRES_URL,
        MODEL,
        pool={"max_in_flight": N, "max_queued": 256},
        shared_admission=admission,
    )
    upstream, responses = await fire(config, instances=2, requests=40)
    assert [r.status_code for r in responses] == [200] * 40 and upstream.served == 40
    if shared:
        assert upstream.peak == N
    else:  # the control: each instance counts only its own
        assert upstream.peak > N


@pytest.mark.parametrize("mode", list(StoreDown))
async def test_an_unreachable_admission_store_is_a_503_naming_it_or_the_local_limit(
    tmp_path: object, mode: StoreDown
) -> None:
    skip_without_services()
    url = f"redis://127.0.0.1:{free_port()}/0"
    config = make_config(
        "http://engine:1",
        POSTGRES_URL,
        MODEL,
        pool={"max_in_flight": N},
        shared_admission=SharedAdmission(url=url, on_store_down=mode),
    )
    upstream, responses = await fire(config, instances=1, requests=10)
    if mode is StoreDown.LOCAL:
        assert [r.status_code for r in responses] == [200] * 10 and upstream.peak == N
        return
    assert {r.status_code for r in responses} == {503} and upstream.served == 0
    error = responses[0].json()["error"]
    assert error["code"] == "admission_store_unavailable" and url in error["message"]
    assert responses[0].headers["retry-after"] == "1"
