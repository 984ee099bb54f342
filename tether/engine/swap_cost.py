"""Move KV or compute it again: the cost model behind the KV tiers' restores and swap-vs-recompute
preemption.

Pure: rates are plain numbers the engine measures as it runs (`RateMeter`, an exponentially weighted mean
of observed amounts per second, starting from a prior) and passes in; the decisions are functions of
them. It knows nothing about tensors, files or the scheduler, and does not model overlap of copies with
compute (a restore or a swap runs before the forward pass that needs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tether.engine.config import PreemptionMode


class Tier(Enum):
    """Where a prefix-cache block's KV can be found."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


# Priors until the first measurement: a CPU model prefills a few thousand tokens a second, a GPU tens of
# thousands; host memory copies run at GB/s (pinned PCIe ~10 GB/s); a local disk reads hundreds of MB/s.
PRIOR_PREFILL_TOKENS_PER_S = {"cpu": 2_000.0, "cuda": 20_000.0}
PRIOR_BYTES_PER_S = {Tier.HOST: 4e9, Tier.DISK: 5e8}


class RateMeter:
    """Amount per second, an exponentially weighted mean of observations that starts at a prior."""

    __slots__ = ("num_observations", "rate", "weight")

    def __init__(self, prior: float, weight: float = 0.3) -> None:
        assert prior > 0 and 0 <= weight <= 1
        self.rate = prior
        self.weight = weight
        """Share of a new observation in the mean; 0 keeps the prior (`fixed`)."""
        self.num_observations = 0

    @classmethod
    def fixed(cls, rate: float) -> RateMeter:
        """A meter that ignores observations: for tests and benchmarks that set the cost model's input."""
        return cls(rate, weight=0.0)

    def observe(self, amount: float, seconds: float) -> None:
        """Record that `amount` (tokens, bytes) took `seconds`; too short a time to measure is ignored."""
        if amount <= 0 or seconds <= 1e-6:
            return
        self.rate += self.weight * (amount / seconds - self.rate)
        self.num_observations += 1


@dataclass(frozen=True, slots=True)
class Rates:
    """What the decisions depend on, as measured now."""

    prefill_tokens_per_s: float
    host_bytes_per_s: float
    """Copies between the device and the host tier, either way."""
    disk_bytes_per_s: float
    """Reads from the disk tier (writes happen off the critical path of the sequence that needs them)."""

    def bytes_per_s(self, tier: Tier) -> float:
        assert tier is not Tier.DEVICE, "device blocks are never moved"
        return self.host_bytes_per_s if tier is Tier.HOST else self.disk_bytes_per_s


def move_seconds(num_bytes: int, bytes_per_s: float) -> float:
    return num_bytes / bytes_per_s


def recompute_seconds(num_tokens: int, tokens_per_s: float) -> float:
    return num_tokens / tokens_per_s


def restore_is_cheaper(bytes_by_tier: dict[Tier, int], num_tokens: int, rates: Rates) -> bool:
    """Whether copying blocks back (so many bytes from each tier) beats prefilling their `num_tokens`."""
    moving = sum(move_seconds(n, rates.bytes_per_s(tier)) for tier, n in bytes_by_tier.items())
    return moving < recompute_seconds(num_tokens, rates.prefill_tokens_per_s)


def choose_preemption(mode: PreemptionMode, num_bytes: int, num_tokens: int, rates: Rates) -> PreemptionMode:
    """SWAP or RECOMPUTE for a sequence holding `num_bytes` of KV for its `num_tokens` computed tokens.

    A swap copies the KV out and later back in (twice the bytes at host speed); a recompute prefills the
    tokens again. "swap" and "recompute" force their answer; "auto" takes the cheaper.
    """
    if mode is not PreemptionMode.AUTO:
        return mode
    swapping = move_seconds(2 * num_bytes, rates.host_bytes_per_s)
    if swapping < recompute_seconds(num_tokens, rates.prefill_tokens_per_s):
        return PreemptionMode.SWAP
    return PreemptionMode.RECOMPUTE
