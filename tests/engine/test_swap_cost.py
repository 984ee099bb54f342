"""The cost model behind restores and swap-vs-recompute preemption, driven by given measurements."""

from __future__ import annotations

import pytest

from tether.engine.config import PreemptionMode
from tether.engine.swap_cost import RateMeter, Rates, Tier, choose_preemption, restore_is_cheaper

BLOCK_BYTES = 1_000_000  # 1 MB of KV for 16 tokens


@pytest.mark.parametrize(
    ("prefill_tokens_per_s", "host_bytes_per_s", "expected"),
    [
        (1_000.0, 10e9, PreemptionMode.SWAP),  # 2 MB at 10 GB/s (0.2 ms) beats 16 tokens at 1k/s (16 ms)
        (1e6, 1e8, PreemptionMode.RECOMPUTE),  # 2 MB at 100 MB/s (20 ms) loses to 16 µs of prefill
    ],
)
def test_auto_swaps_when_moving_is_cheaper_and_recomputes_when_not(
    prefill_tokens_per_s: float, host_bytes_per_s: float, expected: PreemptionMode
) -> None:
    rates = Rates(prefill_tokens_per_s, host_bytes_per_s, 1e8)
    assert choose_preemption(PreemptionMode.AUTO, BLOCK_BYTES, 16, rates) is expected


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
def test_a_forced_mode_ignores_the_rates(mode: PreemptionMode) -> None:
    for rates in (Rates(1.0, 1e12, 1e12), Rates(1e12, 1.0, 1.0)):
        assert choose_preemption(mode, BLOCK_BYTES, 16, rates) is mode


def test_swap_counts_the_bytes_twice_out_and_back() -> None:
    # Moving 1 MB once (1 ms) beats 16 tokens at 10k/s (1.6 ms), but out and back (2 ms) does not.
    rates = Rates(10_000.0, 1e9, 1e9)
    assert restore_is_cheaper({Tier.HOST: BLOCK_BYTES}, 16, rates)
    assert choose_preemption(PreemptionMode.AUTO, BLOCK_BYTES, 16, rates) is PreemptionMode.RECOMPUTE


def test_restore_adds_the_time_of_every_tier() -> None:
    rates = Rates(prefill_tokens_per_s=1_000.0, host_bytes_per_s=1e9, disk_bytes_per_s=1e6)
    assert restore_is_cheaper({Tier.HOST: 10 * BLOCK_BYTES}, 16, rates)  # 10 ms < 16 ms
    assert not restore_is_cheaper({Tier.HOST: BLOCK_BYTES, Tier.DISK: BLOCK_BYTES}, 16, rates)  # 1 s


def test_rate_meter_starts_at_its_prior_and_follows_observations() -> None:
    meter = RateMeter(prior=100.0, weight=0.5)
    assert meter.rate == 100.0
    meter.observe(300.0, 1.0)
    assert meter.rate == 200.0
    meter.observe(0, 1.0)  # nothing moved: no information
    meter.observe(5.0, 0.0)  # too short to time
    assert meter.rate == 200.0 and meter.num_observations == 1


def test_a_fixed_meter_ignores_observations() -> None:
    meter = RateMeter.fixed(42.0)
    meter.observe(1e9, 1.0)
    assert meter.rate == 42.0
