"""Bad bodies on every JSON route of the gateway get a 4xx JSON error naming what is wrong, never a 5xx:
lone UTF-16 surrogates, 100,000 nested arrays, and valid requests broken at random (hypothesis)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz import assert_client_error_or_success, deeply_nested, encode, mutated_bodies
from tests.live_server import live_server
from tether.gateway import Limits, Tier
from tether.gateway.bench import MODEL, instant_upstream

from .conftest import live_gateway, make_config

EXAMPLES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "stream": False,
        "n": 1,
    },
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 1, "stream": False, "n": 1},
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    ledger = tmp_path_factory.mktemp("fuzz") / "ledger.db"
    with (
        live_server(instant_upstream) as upstream,
        live_gateway(
            make_config(upstream, f"sqlite:///{ledger}", model=MODEL, pool={"send_priority": False})
        ) as (url, served),
    ):
        secret, _ = served.keys.create("acme", Tier.STANDARD, Limits(budget_usd=1000))
        headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
            yield client


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {**EXAMPLES["/v1/chat/completions"], "messages": [{"content": "a\ud800"}]},
            "messages",
        ),
        (
            "/v1/chat/completions",
            {
                **EXAMPLES["/v1/chat/completions"],
                "messages": [{"content": [{"type": "text", "text": "\udfff"}]}],
            },
            "messages",
        ),
        ("/v1/completions", {**EXAMPLES["/v1/completions"], "prompt": "hi \udc00 there"}, "prompt"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(
    gateway: httpx.Client, route: str, body: dict[str, Any], param: str
) -> None:
    response = gateway.post(route, content=encode(body))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "lone UTF-16 surrogate" in error["message"]


@pytest.mark.parametrize("route", sorted(EXAMPLES))
def test_a_hundred_thousand_nested_arrays_are_a_400(gateway: httpx.Client, route: str) -> None:
    response = gateway.post(route, content=deeply_nested())
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_json" and "too deeply" in response.text


@pytest.mark.parametrize("route", sorted(EXAMPLES))
def test_a_model_name_with_a_lone_surrogate_is_a_404_that_encodes(gateway: httpx.Client, route: str) -> None:
    response = gateway.post(route, content=encode({**EXAMPLES[route], "model": "m\ud800"}))
    assert response.status_code == 404 and "\\ud800" in response.text


@pytest.mark.parametrize("route", sorted(EXAMPLES))
def test_random_bodies_get_a_client_error_or_an_answer(gateway: httpx.Client, route: str) -> None:
    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(body=mutated_bodies(EXAMPLES[route]))
    def property(body: dict[str, Any]) -> None:
        response = gateway.post(route, content=encode(body))
        assert_client_error_or_success(response.status_code, response.content, route=route)

    property()
