"""Prices per million tokens applied to reported usage, exactly, and the worst case reserved up front."""

from __future__ import annotations

from decimal import Decimal

import pytest

from tether.chat.completion import BadUsage, Usage
from tether.chat.pricing import (
    DEFAULT_PRICES,
    Price,
    Tier,
    cost_usd,
    largest_max_tokens,
    to_nano_usd,
    worst_case_usd,
)
from tether.errors import ConfigError
from tether.gateway.config import DEFAULT_MODEL, parse_gateway_config
from tether.gateway.ledger import to_pico_usd


def test_standard_cost_splits_hits_misses_and_output() -> None:
    # 1000 hits at 0.18, 2000 misses at 1.80, 500 out at 9.50 per million
    cost = cost_usd(
        Usage(prompt_tokens=3000, cached_tokens=1000, completion_tokens=500), DEFAULT_PRICES[Tier.STANDARD]
    )
    assert cost == Decimal("0.00018") + Decimal("0.0036") + Decimal("0.00475") == Decimal("0.00853")


def test_fast_tier_costs_twice_standard() -> None:
    usage = Usage(123, 45, 67)
    fast, standard = DEFAULT_PRICES[Tier.FAST], DEFAULT_PRICES[Tier.STANDARD]
    assert fast.output_per_mtok == Decimal("19.00")
    assert cost_usd(usage, fast) == 2 * cost_usd(usage, standard)


def test_single_token_costs_are_exact_to_the_pico_dollar() -> None:
    cost = cost_usd(Usage(1, 1, 0), Price(input_cache_hit_per_mtok=Decimal("0.000001")))
    assert cost == Decimal("1E-12") and to_pico_usd(cost) == 1
    assert to_nano_usd(Decimal("1E-12")) == 1  # counters round up, never down


def test_worst_case_bounds_every_split() -> None:
    price = DEFAULT_PRICES[Tier.STANDARD]
    bound = worst_case_usd(100, 50, price)
    for cached in (0, 50, 100):
        assert cost_usd(Usage(100, cached, 50), price) <= bound


@pytest.mark.parametrize(
    "usage",
    [
        None,
        [],
        {"prompt_tokens": 1},
        {"prompt_tokens": "3", "completion_tokens": 1},
        {"prompt_tokens": True, "completion_tokens": 1},
    ],
)
def test_malformed_usage_is_refused(usage: object) -> None:
    with pytest.raises(BadUsage):
        Usage.from_openai(usage)


def test_inconsistent_usage_is_refused() -> None:
    with pytest.raises(BadUsage, match="cached_tokens exceeds"):
        Usage(3, 4, 0)
    with pytest.raises(BadUsage, match=">= 0"):
        Usage(3, 0, -1)


def test_usage_without_cache_details_counts_no_hits() -> None:
    assert Usage.from_openai({"prompt_tokens": 5, "completion_tokens": 2}) == Usage(5, 0, 2)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"prices": {"default": {"fast": {"output_per_mtok": "1.0000001"}}}}, "at most 6 decimal places"),
        ({"prices": {"default": {"fast": {"output_per_mtok": -1}}}}, "greater than or equal to 0"),
        ({"prices": {"other": {"fast": {}}}}, "configured but not served"),
        ({"models": {"m": "nowhere"}}, "known pools"),
        ({"tier_priority": {"fast": 1}}, "missing"),
        ({"table_prefix": "x;drop"}, "letters, digits"),
        ({"unknown": 1}, "unknown key"),
    ],
)
def test_bad_gateway_configs_name_the_problem(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_gateway_config(data)


def test_configured_prices_override_the_defaults() -> None:
    model = DEFAULT_MODEL
    config = parse_gateway_config({"prices": {model: {"standard": {"output_per_mtok": "2.5"}}}})
    assert config.price(model, Tier.STANDARD).output_per_mtok == Decimal("2.5")
    assert config.price(model, Tier.FAST) == DEFAULT_PRICES[Tier.FAST]


@pytest.mark.parametrize(
    ("spend_nano_usd", "prompt_tokens", "n", "fits"),
    [
        (1_000_000, 10, 1, 103),  # (1,000 - 10 x 1.80) / 9.50 = 103.4 micro-USD per output token
        (1_000_000, 10, 2, 51),
        (18_000, 10, 1, 0),  # the prompt alone costs 18.0: nothing left for output
        (17_000, 10, 1, 0),
    ],
)
def test_largest_max_tokens_is_the_most_that_fits(
    spend_nano_usd: int, prompt_tokens: int, n: int, fits: int
) -> None:
    price = DEFAULT_PRICES[Tier.STANDARD]
    assert largest_max_tokens(spend_nano_usd, prompt_tokens, n, price) == fits
    worst = to_nano_usd(worst_case_usd(prompt_tokens, (fits + 1) * n, price))
    assert worst > spend_nano_usd  # one more does not fit
