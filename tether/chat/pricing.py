"""Token pricing: the service tiers and their prices per million tokens, the exact cost of a request from
the engine's reported usage, and the worst-case cost reserved before it runs. Pure decimal arithmetic; no
I/O, no floats. The gateway bills with it and RL runs report what their rollouts would cost with it."""

from __future__ import annotations

import math
from decimal import Decimal
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tether.chat.completion import Usage


class Tier(StrEnum):
    STANDARD = "standard"
    FAST = "fast"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Price(_Strict):
    """USD per million tokens."""

    input_cache_hit_per_mtok: Decimal = Field(Decimal("0.18"), ge=0)
    input_cache_miss_per_mtok: Decimal = Field(Decimal("1.80"), ge=0)
    output_per_mtok: Decimal = Field(Decimal("9.50"), ge=0)

    @field_validator("*")
    @classmethod
    def _at_most_six_decimals(cls, value: Decimal) -> Decimal:
        # the ledger counts whole pico-dollars: with <= 6 decimals per million tokens every cost is exact
        exponent = value.as_tuple().exponent
        if not isinstance(exponent, int) or exponent < -6:
            raise ValueError(f"{value}: use at most 6 decimal places (USD per million tokens)")
        return value

    def scaled(self, factor: Decimal) -> Price:
        return Price(
            input_cache_hit_per_mtok=self.input_cache_hit_per_mtok * factor,
            input_cache_miss_per_mtok=self.input_cache_miss_per_mtok * factor,
            output_per_mtok=self.output_per_mtok * factor,
        )


DEFAULT_PRICES: dict[Tier, Price] = {Tier.STANDARD: Price(), Tier.FAST: Price().scaled(Decimal(2))}


MILLION = Decimal(1_000_000)
NANO_PER_USD = Decimal(1_000_000_000)


def cost_usd(usage: Usage, price: Price) -> Decimal:
    """Cache hits, cache misses and output, each at its own price per million tokens; exact."""
    missed = usage.prompt_tokens - usage.cached_tokens
    total = (
        usage.cached_tokens * price.input_cache_hit_per_mtok
        + missed * price.input_cache_miss_per_mtok
        + usage.completion_tokens * price.output_per_mtok
    )
    return total / MILLION


def worst_case_usd(prompt_tokens: int, completion_tokens: int, price: Price) -> Decimal:
    """The most a request can cost: every prompt token a cache miss (or a hit, if hits cost more)."""
    input_price = max(price.input_cache_miss_per_mtok, price.input_cache_hit_per_mtok)
    return (prompt_tokens * input_price + completion_tokens * price.output_per_mtok) / MILLION


def to_nano_usd(amount: Decimal) -> int:
    """Whole nano-dollars, rounded up, for the integer limit counters (the ledger keeps exact decimals)."""
    return math.ceil(amount * NANO_PER_USD)


def largest_max_tokens(spend_nano_usd: int, prompt_tokens: int, n: int, price: Price) -> int:
    """The largest `max_tokens` whose worst case, with `n` choices after a prompt of at most
    `prompt_tokens`, fits in `spend_nano_usd`; 0 if none does (or output is free, when `max_tokens` is
    never what does not fit)."""
    input_price = max(price.input_cache_miss_per_mtok, price.input_cache_hit_per_mtok)
    room = Decimal(spend_nano_usd) / NANO_PER_USD * MILLION - prompt_tokens * input_price
    per_token = price.output_per_mtok * n
    if room < 0 or per_token == 0:
        return 0
    fits = int(room / per_token)
    assert to_nano_usd(worst_case_usd(prompt_tokens, fits * n, price)) <= spend_nano_usd
    return fits
