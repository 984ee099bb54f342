"""What a run's rollouts would cost at the gateway's prices: tokens per step, dollars per tier, sandbox CPU.

Pure: the arithmetic is the gateway's own (`tether.chat.pricing.cost_usd`, exact decimals). A step's
metrics carry its token counts (integers, exact as floats up to 2**53) and its cost per tier as a float
for plotting; a run's total is computed from the summed token counts, so it is exact and needs nothing
but `metrics.jsonl` (a resumed run's truncated lines included). Prompt tokens are what the engine read
(`Rollout.billed_prompt_tokens`), cached or not as its prefix cache found them; a remote server that
reports no cached count bills every prompt token as a cache miss. This module reads and writes no file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from tether.chat import Usage
from tether.chat.pricing import Price, Tier, cost_usd
from tether.rl.rollout import Rollout

COST_FILE = "cost.json"  # in the run directory: the exact totals, as decimal strings
PROMPT_CACHED = "tokens/prompt_cached"
PROMPT_UNCACHED = "tokens/prompt_uncached"
OUTPUT = "tokens/output"
SANDBOX_CPU = "sandbox/cpu_s"


def cost_key(tier: Tier) -> str:
    return f"cost/{tier.value}_usd"


def total_usage(rollouts: Iterable[Rollout]) -> Usage:
    """The token counts of a set of rollouts, as one usage."""
    usages = [rollout.usage for rollout in rollouts]
    return Usage(
        sum(u.prompt_tokens for u in usages),
        sum(u.cached_tokens for u in usages),
        sum(u.completion_tokens for u in usages),
    )


def usage_metrics(usage: Usage, prices: Mapping[Tier, Price]) -> dict[str, float]:
    """Token counts and the cost of each tier (floats: for plots; totals come from `CostSummary`)."""
    out = {
        PROMPT_CACHED: float(usage.cached_tokens),
        PROMPT_UNCACHED: float(usage.prompt_tokens - usage.cached_tokens),
        OUTPUT: float(usage.completion_tokens),
    }
    out.update({cost_key(tier): float(cost_usd(usage, price)) for tier, price in prices.items()})
    return out


def cost_metrics(rollouts: Sequence[Rollout], prices: Mapping[Tier, Price]) -> dict[str, float]:
    """A step's tokens, cost per tier and sandbox CPU seconds."""
    out = usage_metrics(total_usage(rollouts), prices)
    out[SANDBOX_CPU] = sum(rollout.sandbox_cpu_s for rollout in rollouts)
    return out


def usage_of_rows(rows: Iterable[Mapping[str, float]]) -> Usage:
    """The summed token counts of metrics rows (rows from before tokens were recorded count 0)."""
    cached = uncached = output = 0
    for row in rows:
        cached += int(row.get(PROMPT_CACHED, 0))
        uncached += int(row.get(PROMPT_UNCACHED, 0))
        output += int(row.get(OUTPUT, 0))
    return Usage(cached + uncached, cached, output)


@dataclass(frozen=True, slots=True)
class CostSummary:
    """A run's tokens and what they cost per tier, exactly."""

    steps: int
    usage: Usage
    prices: dict[Tier, Price]
    sandbox_cpu_s: float

    @property
    def usd(self) -> dict[Tier, Decimal]:
        return {tier: cost_usd(self.usage, price) for tier, price in self.prices.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, amounts as exact decimal strings (`cost/<tier>_usd_total`)."""
        return {
            "steps": self.steps,
            "tokens": {
                "prompt_cached": self.usage.cached_tokens,
                "prompt_uncached": self.usage.prompt_tokens - self.usage.cached_tokens,
                "output": self.usage.completion_tokens,
            },
            **{f"{cost_key(tier)}_total": str(amount) for tier, amount in self.usd.items()},
            "prices": {tier.value: price.model_dump(mode="json") for tier, price in self.prices.items()},
            "sandbox_cpu_s": self.sandbox_cpu_s,
        }


def summarize(rows: Sequence[Mapping[str, float]], prices: Mapping[Tier, Price]) -> CostSummary:
    """The run's cost from its metrics rows, at `prices`."""
    return CostSummary(
        len(rows), usage_of_rows(rows), dict(prices), sum(row.get(SANDBOX_CPU, 0.0) for row in rows)
    )
