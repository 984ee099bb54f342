"""Token pricing: the exact cost of a request from the engine's reported usage, and the worst-case cost
reserved before it runs. Pure decimal arithmetic; no I/O, no floats."""

from __future__ import annotations

import math
from decimal import Decimal

from tether.chat.completion import Usage
from tether.gateway.config import Price

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
