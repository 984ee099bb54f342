"""The gateway in front of a real engine (tiny random Qwen3) with the official openai client: pass-through,
exact costs for cache hits and misses, keys, limits and their errors, the ledger, metrics."""

from __future__ import annotations

import asyncio
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.live_server import live_server
from tether.chat import Usage
from tether.gateway import GatewayConfig, Limits, Pool, Tier, create_gateway_app
from tether.gateway.config import DEFAULT_MODEL

from .conftest import TINY, engine_server, live_gateway, make_config, unique_prefix
from .helpers import Served, expected_cost, serve

# long enough to span several 16-token KV blocks, so a repeat hits the prefix cache
PROMPT = "The gateway prices cached prompt tokens at a tenth of uncached ones. " * 2


def fresh(prompt: str = PROMPT) -> str:
    """A prompt no earlier test sent: the engine's prefix cache outlives each test."""
    return f"{uuid.uuid4().hex} {prompt}"


@pytest.fixture
async def served(tiny_engine_url: str, ledger_url: str) -> Any:
    async with serve(make_config(tiny_engine_url, ledger_url)) as served:
        yield served


def usage_of(response: Any) -> Usage:
    """From a response, or from a streamed chunk's usage."""
    usage = getattr(response, "usage", None) or response
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else 0
    return Usage(usage.prompt_tokens, cached or 0, usage.completion_tokens)


async def test_chat_costs_are_exact_for_cache_misses_then_hits(served: Served) -> None:
    client = served.openai(served.key("acme"))
    usages = []
    prompt = fresh()
    for _ in range(2):
        response = await client.chat.completions.create(
            model=TINY, messages=[{"role": "user", "content": prompt}], max_tokens=5
        )
        assert response.choices[0].message.content is not None
        usages.append(usage_of(response))
    assert usages[0].cached_tokens == 0 and usages[1].cached_tokens >= 16
    await served.gateway.flush()
    rows = served.gateway.ledger.report("acme", since=0)
    assert len(rows) == 1 and rows[0].requests == 2 and rows[0].tier is Tier.STANDARD
    assert rows[0].prompt_tokens == sum(u.prompt_tokens for u in usages)
    assert rows[0].cached_tokens == sum(u.cached_tokens for u in usages)
    assert rows[0].completion_tokens == sum(u.completion_tokens for u in usages)
    assert rows[0].cost_usd == sum(expected_cost(u, Tier.STANDARD) for u in usages)


async def test_cost_header_and_fast_tier_pricing(served: Served) -> None:
    body = {"model": TINY, "prompt": PROMPT, "max_tokens": 4}
    costs = {}
    for tier in Tier:
        secret = served.key(f"t-{tier.value}", tier)
        response = await served.http.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
        )
        assert response.status_code == 200, response.text
        usage = Usage.from_openai(response.json()["usage"])
        costs[tier] = Decimal(response.headers["x-tether-cost-usd"])
        assert costs[tier] == expected_cost(usage, tier)
        await served.gateway.flush()
        assert served.gateway.ledger.report(f"t-{tier.value}", 0)[0].cost_usd == costs[tier]


@pytest.mark.parametrize("include_usage", [True, False])
async def test_streaming_chat_relays_chunks_and_charges_usage(served: Served, include_usage: bool) -> None:
    client = served.openai(served.key("acme"))
    stream = await client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": include_usage},
    )
    text, usages = "", []
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usages.append(chunk.usage)
    assert text
    await served.gateway.flush()
    rows = served.gateway.ledger.report("acme", 0)
    assert rows[0].requests == 1 and rows[0].completion_tokens == 6
    if include_usage:
        assert len(usages) == 1 and usages[0].completion_tokens == 6
        assert rows[0].cost_usd == expected_cost(
            Usage(usages[0].prompt_tokens, usage_of(usages[0]).cached_tokens, 6), Tier.STANDARD
        )
    else:
        assert usages == []  # the gateway asked for usage for itself and dropped it


async def test_models_lists_the_configured_models(served: Served) -> None:
    models = await served.openai(served.key()).models.list()
    assert [model.id for model in models.data] == [TINY]


async def test_completion_routes_answer_other_methods_and_trailing_slashes_as_before(served: Served) -> None:
    response = await served.http.get("/v1/chat/completions")
    assert response.status_code == 405 and response.json() == {"detail": "Method Not Allowed"}
    assert response.headers["allow"] == "POST"
    response = await served.http.post("/v1/completions/", json={})
    assert response.status_code == 307 and response.headers["location"].endswith("/v1/completions")


async def test_a_client_gone_before_its_body_arrived_is_counted_and_not_answered(served: Served) -> None:
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    headers = [(b"authorization", f"Bearer {served.key()}".encode())]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    await create_gateway_app(served.gateway)(scope, receive, send)
    assert sent == []
    requests = {"tier": "standard", "status": "499"}
    assert served.gateway.metrics.registry.get_sample_value("tether_gateway_requests_total", requests) == 1


async def test_revoked_and_unknown_keys_are_refused(served: Served) -> None:
    secret, record = served.gateway.keys.create(
        "acme", Tier.STANDARD, served.gateway.config.default_key_limits
    )
    client = served.openai(secret)
    await client.completions.create(model=TINY, prompt="hi", max_tokens=1)
    served.gateway.keys.revoke(record.key_id)
    with pytest.raises(openai.AuthenticationError) as refused:
        await client.completions.create(model=TINY, prompt="hi", max_tokens=1)
    assert refused.value.code == "key_revoked"
    with pytest.raises(openai.AuthenticationError) as unknown:
        await served.openai(secret + "x").completions.create(model=TINY, prompt="hi", max_tokens=1)
    assert unknown.value.code == "invalid_api_key"
    missing = await served.http.post("/v1/completions", json={"model": TINY, "prompt": "hi"})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
    await served.gateway.flush()
    assert len(served.gateway.ledger.report("acme", 0)) == 1


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "gpt-9", "prompt": "hi"}, 404, "model"),
        ({"model": TINY, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": TINY, "prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
        ({"model": TINY, "prompt": "hi", "n": -1}, 400, "n"),
        ({"model": TINY, "prompt": "hi", "stream": "yes"}, 400, "stream"),
        ({"model": TINY, "prompt": ""}, 400, "prompt"),
        ({"model": TINY, "prompt": [1, "x"]}, 400, "prompt"),
        ({"model": TINY, "prompt": "hi", "stream": True, "stream_options": 3}, 400, "stream_options"),
        ([1, 2], 400, None),
    ],
)
async def test_bad_requests_get_openai_errors_naming_the_field(
    served: Served, body: Any, status: int, param: str | None
) -> None:
    headers = {"Authorization": f"Bearer {served.key()}"}
    response = await served.http.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


async def test_bad_chat_messages_and_invalid_json_are_refused(served: Served) -> None:
    headers = {"Authorization": f"Bearer {served.key()}", "content-type": "application/json"}
    for messages in ([], [3], [{"role": "user", "content": 5}]):
        response = await served.http.post(
            "/v1/chat/completions", json={"model": TINY, "messages": messages}, headers=headers
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages", response.text
    response = await served.http.post("/v1/chat/completions", content=b"{nope", headers=headers)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


async def test_requests_per_minute_limit_returns_429_with_retry_after(served: Served) -> None:
    client = served.openai(served.key("acme", requests_per_minute=2))
    for _ in range(2):
        await client.completions.create(model=TINY, prompt="hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as refused:
        await client.completions.create(model=TINY, prompt="hi", max_tokens=1)
    assert refused.value.code == "requests_limit_exceeded"
    assert "2 requests per minute" in refused.value.message
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 60


async def test_tenant_token_window_is_shared_by_its_keys(tiny_engine_url: str, ledger_url: str) -> None:
    config = make_config(tiny_engine_url, ledger_url, tenant_limits={"acme": {"tokens_per_window": 150}})
    async with serve(config) as served:
        first, second = served.openai(served.key("acme")), served.openai(served.key("acme"))
        # a reservation is 64 + 2 bytes + 60 output = 126 tokens; the first settles to 2 + 60 = 62, and
        # 62 + 126 > 150
        await first.completions.create(
            model=TINY, prompt="hi", max_tokens=60, extra_body={"ignore_eos": True}
        )
        await served.gateway.flush()  # settled to its actual 62 tokens
        with pytest.raises(openai.RateLimitError) as refused:
            await second.completions.create(
                model=TINY, prompt="hi", max_tokens=60, extra_body={"ignore_eos": True}
            )
        assert refused.value.code == "tokens_limit_exceeded" and "tenant 'acme'" in refused.value.message
        assert "retry-after" in refused.value.response.headers
        await served.openai(served.key("other")).completions.create(model=TINY, prompt="hi", max_tokens=1)


async def test_exhausted_budget_is_a_distinct_error(served: Served) -> None:
    # 0.0015 USD: the first request (worst case < 0.001 USD) fits, then its real cost plus the next
    # worst case does not
    client = served.openai(served.key("acme", budget_usd="0.0015"))
    body: dict[str, Any] = {"model": TINY, "prompt": "x" * 40, "max_tokens": 80}
    await client.completions.create(**body)
    with pytest.raises(openai.RateLimitError) as refused:
        for _ in range(5):
            await client.completions.create(**body)
    assert refused.value.code == "budget_exhausted" and refused.value.type == "insufficient_quota"
    # the cause named first: the request's worst case does not fit in what is left, and waiting helps
    message = refused.value.message
    assert "this request may cost up to" in message and "USD left of key" in message, message
    assert int(refused.value.response.headers["retry-after"]) >= 1
    await served.gateway.flush()
    spent = served.gateway.ledger.report("acme", 0)[0].cost_usd
    assert spent <= Decimal("0.0015")


async def test_request_costlier_than_the_whole_budget_is_a_400_naming_the_max_tokens_that_fits(
    served: Served,
) -> None:
    # 0.001 USD: the prompt bound, 64 + 2 bytes at 1.80 per million, leaves 881.2 micro-USD, which pays
    # for 92 output tokens at 9.50; waiting would never let 200 fit
    client = served.openai(served.key("acme", budget_usd="0.001"))
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model=TINY, prompt="hi", max_tokens=200)
    assert refused.value.code == "request_exceeds_budget" and refused.value.param == "max_tokens"
    assert "lower max_tokens to 92 or less" in refused.value.message, refused.value.message
    assert "retry-after" not in refused.value.response.headers
    await client.completions.create(model=TINY, prompt="hi", max_tokens=92)


async def test_request_larger_than_the_whole_window_is_a_400(served: Served) -> None:
    client = served.openai(served.key("acme", tokens_per_window=100))
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model=TINY, prompt="hi", max_tokens=200)
    assert refused.value.code == "request_exceeds_limit"
    assert "lower max_tokens to 34 or less" in refused.value.message  # 100 - 64 - 2 prompt bytes


async def test_engine_refusals_pass_through_and_release_the_reservation(served: Served) -> None:
    key_secret = served.key("acme", tokens_per_window=1000)
    client = served.openai(key_secret)
    with pytest.raises(openai.BadRequestError) as refused:  # the tiny engine's context is 256 tokens
        await client.completions.create(model=TINY, prompt="y" * 300, max_tokens=10)
    assert refused.value.code == "context_length_exceeded"
    key = served.gateway.keys.lookup(key_secret)
    assert key is not None
    counter = next(c for c in served.gateway.limits.core.logs if c.endswith(":tokens"))  # type: ignore[attr-defined]
    assert served.gateway.limits.core.logs[counter].total == 0  # type: ignore[attr-defined]
    await served.gateway.flush()
    assert served.gateway.ledger.report("acme", 0) == []


async def test_unreachable_upstream_is_a_502(ledger_url: str) -> None:
    async with serve(make_config("http://127.0.0.1:9", ledger_url)) as served:
        response = await served.http.post(
            "/v1/completions",
            json={"model": TINY, "prompt": "hi"},
            headers={"Authorization": f"Bearer {served.key()}"},
        )
        assert response.status_code == 502 and response.json()["error"]["code"] == "upstream_error"


async def test_metrics_count_requests_tokens_cost_and_errors(served: Served) -> None:
    secret = served.key("acme", requests_per_minute=1)
    headers = {"Authorization": f"Bearer {secret}"}
    body = {"model": TINY, "prompt": PROMPT, "max_tokens": 3}
    assert (await served.http.post("/v1/completions", json=body, headers=headers)).status_code == 200
    assert (await served.http.post("/v1/completions", json=body, headers=headers)).status_code == 429
    registry = served.gateway.metrics.registry
    assert (
        registry.get_sample_value("tether_gateway_requests_total", {"tier": "standard", "status": "200"}) == 1
    )
    assert (
        registry.get_sample_value("tether_gateway_requests_total", {"tier": "standard", "status": "429"}) == 1
    )
    assert registry.get_sample_value("tether_gateway_errors_total", {"code": "requests_limit_exceeded"}) == 1
    out = registry.get_sample_value(
        "tether_gateway_tokens_total", {"tenant": "acme", "tier": "standard", "kind": "output"}
    )
    assert out == 3
    cost = registry.get_sample_value("tether_gateway_cost_usd_total", {"tenant": "acme", "tier": "standard"})
    assert cost is not None and cost > 0
    text = (await served.http.get("/metrics")).text
    assert "tether_gateway_queue_depth" in text and "tether_gateway_request_latency_seconds_bucket" in text


async def test_concurrent_requests_on_one_key_all_reach_the_ledger(served: Served) -> None:
    client = served.openai(served.key("acme"))
    responses = await asyncio.gather(
        *(client.completions.create(model=TINY, prompt=f"{i} {PROMPT}", max_tokens=3) for i in range(12))
    )
    await served.gateway.flush()
    rows = served.gateway.ledger.report("acme", 0)
    assert rows[0].requests == 12
    assert rows[0].cost_usd == sum(expected_cost(usage_of(r), Tier.STANDARD) for r in responses)
    assert isinstance(served.http, httpx.AsyncClient)


async def test_requests_past_the_admission_bound_get_503_with_retry_after(
    tiny_engine_url: str, ledger_url: str
) -> None:
    config = make_config(tiny_engine_url, ledger_url, pool={"max_in_flight": 1, "max_queued": 1})
    async with serve(config) as served:
        headers = {"Authorization": f"Bearer {served.key('acme', tokens_per_window=10_000)}"}
        body = {"model": TINY, "prompt": fresh("hi"), "max_tokens": 120, "ignore_eos": True}
        responses = await asyncio.gather(
            *(served.http.post("/v1/completions", json=body, headers=headers) for _ in range(3))
        )
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200, 200, 503]
        refused = next(r for r in responses if r.status_code == 503)
        assert refused.json()["error"]["code"] == "queue_full" and int(refused.headers["retry-after"]) >= 1
        await served.gateway.flush()
        used = served.gateway.limits.core.logs  # type: ignore[attr-defined]
        tokens = next(log for name, log in used.items() if name.endswith(":tokens"))
        assert tokens.total == sum(
            r.json()["usage"]["total_tokens"] for r in responses if r.status_code == 200
        )


async def broken_upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An upstream whose every answer is a proxy's HTML error page."""
    assert scope["type"] == "http"
    body = b"<html>Internal Server Error</html>"
    headers = [(b"content-type", b"text/html"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 500, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def test_upstream_failures_that_are_not_openai_errors_become_502(ledger_url: str) -> None:
    with live_server(broken_upstream) as upstream:
        async with serve(make_config(upstream, ledger_url)) as served:
            secret = served.key("acme", tokens_per_window=5000)
            for _ in range(2):  # the second goes over the connection the first left open
                response = await served.http.post(
                    "/v1/completions",
                    json={"model": TINY, "prompt": "hi"},
                    headers={"Authorization": f"Bearer {secret}"},
                )
                assert response.status_code == 502 and "HTTP 500" in response.json()["error"]["message"]
            logs = served.gateway.limits.core.logs  # type: ignore[attr-defined]
            assert [log.total for name, log in logs.items() if name.endswith(":tokens")] == [0]  # released


async def test_guessed_keys_are_not_cached(served: Served) -> None:
    for i in range(20):
        response = await served.http.post(
            "/v1/completions",
            json={"model": TINY, "prompt": "hi"},
            headers={"Authorization": f"Bearer guess{i}"},
        )
        assert response.status_code == 401
    assert served.gateway._key_cache == {}


async def test_an_abandoned_stream_frees_its_slot_and_keeps_its_reservation(
    tiny_engine_url: str, tmp_path: Path
) -> None:
    config = make_config(tiny_engine_url, f"sqlite:///{tmp_path}/ledger.db")
    with live_gateway(config) as (url, gateway):
        secret, record = gateway.keys.create("acme", Tier.STANDARD, Limits(tokens_per_window=5000))
        prompt = fresh("hi")
        body = {"model": TINY, "prompt": prompt, "max_tokens": 150, "ignore_eos": True, "stream": True}
        async with (
            httpx.AsyncClient(base_url=url, timeout=60) as http,
            http.stream(
                "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
            ) as r,
        ):
            assert r.status_code == 200
            async for _ in r.aiter_bytes():
                break  # leave after the first chunk
        queue = gateway.queues["engine"]
        deadline = time.monotonic() + 10
        while queue.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert queue.in_flight == 0
        logs = gateway.limits.core.logs  # type: ignore[attr-defined]
        reserved = 64 + len(prompt) + 150
        assert logs[f"key:{record.key_id}:tokens"].total == reserved  # unknown usage: the reservation stands
        assert (
            gateway.metrics.registry.get_sample_value(
                "tether_gateway_errors_total", {"code": "stream_incomplete"}
            )
            == 1
        )


async def test_the_default_config_reaches_an_engine_serving_tether_serves_default_model(
    tiny_path: Path, tmp_path: Path
) -> None:
    # `tether serve` with its defaults serves under DEFAULT_MODEL; only the port differs here
    with engine_server(tiny_path, DEFAULT_MODEL, kv_cache_mib=4, max_model_len=256) as url:
        defaults = GatewayConfig()
        config = defaults.model_copy(
            update={
                "pools": {"default": defaults.pools["default"].model_copy(update={"urls": [url]})},
                "ledger_url": f"sqlite:///{tmp_path / 'ledger.db'}",
            }
        )
        async with serve(config) as served:
            client = served.openai(served.key())
            models = await client.models.list()
            answer = await client.chat.completions.create(
                model=models.data[0].id, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
    assert answer.model == DEFAULT_MODEL and answer.usage is not None


async def test_a_model_is_sent_upstream_under_its_engine_name(tiny_engine_url: str, tmp_path: Path) -> None:
    config = GatewayConfig(
        models={"chat": "engine"},
        upstream_models={"chat": TINY},
        pools={"engine": Pool(urls=[tiny_engine_url])},
        ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}",
        table_prefix=unique_prefix(),
    )
    async with serve(config) as served:
        client = served.openai(served.key())
        await client.completions.create(model="chat", prompt="hi", max_tokens=1)
        await served.gateway.flush()
        assert [row.model for row in served.gateway.ledger.report("acme", since=0)] == ["chat"]
