"""Planning a request from its body alone: the tier's priority and pool, a bounded output, usage always
streamed upstream, and reservations that bound the real usage."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tether.chat.pricing import Tier
from tether.gateway.config import GatewayConfig, Pool
from tether.gateway.errors import GatewayError
from tether.gateway.plan import plan_request

CONFIG = GatewayConfig(
    models={"m": "shared"},
    pools={
        "shared": Pool(urls=["http://a"]),
        "vip": Pool(urls=["http://b"]),
        "plain": Pool(urls=["http://c"], send_priority=False),
    },
    fast_pools={"m": "vip"},
)


def sent(plan_body: bytes) -> dict[str, Any]:
    return dict(json.loads(plan_body))


def test_the_tier_sets_priority_and_pool_whatever_the_client_asks() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 3, "priority": 99}
    standard = plan_request("text", body, Tier.STANDARD, CONFIG)
    fast = plan_request("text", body, Tier.FAST, CONFIG)
    assert (standard.pool, sent(standard.upstream_body)["priority"]) == ("shared", 0)
    assert (fast.pool, sent(fast.upstream_body)["priority"]) == ("vip", 10)


def test_pools_that_do_not_take_priority_get_none() -> None:
    config = CONFIG.model_copy(update={"models": {"m": "plain"}, "fast_pools": {}})
    plan = plan_request("text", {"model": "m", "prompt": "hi", "priority": 5}, Tier.FAST, config)
    assert "priority" not in sent(plan.upstream_body)


def test_missing_max_tokens_is_bounded_and_streams_always_report_usage() -> None:
    plan = plan_request(
        "chat",
        {"model": "m", "messages": [{"role": "user", "content": "hé"}], "stream": True},
        Tier.STANDARD,
        CONFIG,
    )
    body = sent(plan.upstream_body)
    assert body["max_tokens"] == CONFIG.estimate.default_max_tokens == plan.output_tokens_bound
    assert body["stream_options"] == {"include_usage": True} and not plan.client_wants_usage
    # 64 per request + 8 per message + 3 UTF-8 bytes of "hé"
    assert plan.prompt_tokens_bound == 64 + 8 + 3


def test_reservations_count_every_sample_and_exact_token_prompts() -> None:
    plan = plan_request(
        "text", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "n": 4}, Tier.STANDARD, CONFIG
    )
    assert (plan.prompt_tokens_bound, plan.output_tokens_bound, plan.tokens_bound) == (3, 20, 23)
    # worst case: 3 tokens at the miss price and 20 at the output price, in nano-dollars rounded up
    assert plan.spend_bound_nano_usd == 3 * 1800 + 20 * 9500


def test_chat_content_parts_count_their_text() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "text", "text": "de"}]}
    ]
    plan = plan_request(
        "chat", {"model": "m", "messages": messages, "max_completion_tokens": 2}, Tier.STANDARD, CONFIG
    )
    assert plan.prompt_tokens_bound == 64 + 8 + 5 and plan.output_tokens_bound == 2


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("chat", {"model": "m", "messages": "hi"}, "messages"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": {"x": 1}}]}, "messages"),
        (
            "chat",
            {"model": "m", "messages": [{"role": "user"}], "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
        ("text", {"model": "m", "prompt": None}, "prompt"),
        ("text", {"model": "m", "prompt": "x", "n": True}, "n"),
        ("text", {"model": 3, "prompt": "x"}, "model"),
    ],
)
def test_bad_bodies_name_the_field(kind: Any, body: dict[str, Any], param: str) -> None:
    with pytest.raises(GatewayError) as refused:
        plan_request(kind, body, Tier.STANDARD, CONFIG)
    assert refused.value.param == param and refused.value.status in (400, 404)
