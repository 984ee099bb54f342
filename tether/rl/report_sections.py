"""The sections of a train config about what a run reports beside its rewards: `[cost]`, the price table
its rollouts are costed at (`cost.py`), and `[monitors]`, the thresholds of the reward-hacking monitors
(`monitors.py`)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from tether.chat.pricing import DEFAULT_PRICES, Price, Tier
from tether.rl.sections import Section


class CostSection(Section):
    """`[cost]`: the price table a run's rollouts are costed at; a tier left unset keeps the gateway's
    default (`tether.chat.pricing.DEFAULT_PRICES`)."""

    standard: Price | None = Field(
        None,
        description="USD per million tokens of the standard tier: input_cache_hit_per_mtok, "
        "input_cache_miss_per_mtok, output_per_mtok (unset: the gateway's default).",
    )
    fast: Price | None = Field(
        None, description="USD per million tokens of the fast tier (unset: the gateway's default)."
    )

    @property
    def prices(self) -> dict[Tier, Price]:
        chosen = {Tier.STANDARD: self.standard, Tier.FAST: self.fast}
        return {tier: price or DEFAULT_PRICES[tier] for tier, price in chosen.items()}


class Monitor(StrEnum):
    QC_VIOLATION_RATE = "qc_violation_rate"
    EXPLOIT_REWARD_SHARE = "exploit_reward_share"
    REWARD_LENGTH_CORRELATION = "reward_length_correlation"
    JUDGE_DISAGREEMENT = "judge_disagreement"


class MonitorsSection(Section):
    """`[monitors]`: the threshold above which each reward-hacking monitor warns."""

    qc_violation_rate: float = Field(
        0.05, ge=0, le=1, description="Warn above this share of a domain's rollouts breaking its rules."
    )
    exploit_reward_share: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Warn above this share of a domain's reward earned by answers matching a known exploit.",
    )
    reward_length_correlation: float = Field(
        0.7, ge=-1, le=1, description="Warn above this Pearson correlation of reward and response length."
    )
    correlation_min_rollouts: int = Field(
        8, ge=3, description="Scored rollouts a domain needs in a step before its correlation is computed."
    )
    judge_disagreement: float = Field(
        0.3,
        ge=0,
        le=1,
        description="Warn above this share of rollouts where the judge and the other components disagree.",
    )

    def threshold(self, monitor: Monitor) -> float:
        value: float = getattr(self, monitor.value)
        return value
