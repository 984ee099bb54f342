"""The clipped objective, KL and reductions against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from tether.rl.losses import (
    Aggregation,
    LossConfig,
    Normaliser,
    aggregate,
    clipped_token_loss,
    k3_kl,
    policy_loss,
)


def _lp(ratio: float) -> torch.Tensor:
    return torch.tensor([[math.log(ratio)]])


@pytest.mark.parametrize(
    ("ratio", "advantage", "clip_high", "expected", "clipped"),
    [
        (1.5, 1.0, 0.2, -1.2, True),  # positive advantage: gains stop at 1 + high
        (1.5, -1.0, 0.2, 1.5, False),  # negative advantage: the pessimistic unclipped term wins
        (0.5, -1.0, 0.2, 0.8, True),  # negative advantage: gains stop at 1 - low
        (1.25, 1.0, 0.2, -1.2, True),
        (1.25, 1.0, 0.28, -1.25, False),  # DAPO clip-higher lets this ratio through
    ],
)
def test_clipped_token_loss(
    ratio: float, advantage: float, clip_high: float, expected: float, clipped: bool
) -> None:
    loss, was_clipped = clipped_token_loss(
        _lp(ratio), torch.zeros(1, 1), torch.tensor([advantage]), clip_low=0.2, clip_high=clip_high
    )
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert bool(was_clipped.item()) is clipped


def test_k3_kl_hand_value_and_zero_at_equality() -> None:
    kl = k3_kl(torch.tensor([0.0, -1.0]), torch.tensor([math.log(0.5), -1.0]))
    assert kl[0].item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert kl[1].item() == 0.0


VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        (Aggregation.TOKEN_MEAN, 10 / 4),  # (1 + 2 + 3 + 4) / 4 tokens
        (Aggregation.SEQUENCE_MEAN, (2 + 4) / 2),  # per-sequence means 2 and 4
        (Aggregation.SEQUENCE_SUM, 10 / (2 * 3)),  # Dr. GRPO: 2 sequences * 3 max tokens
    ],
)
def test_aggregate_ignores_masked_tokens(how: Aggregation, expected: float) -> None:
    assert aggregate(VALUES, MASK, how).item() == pytest.approx(expected)


@pytest.mark.parametrize("how", list(Aggregation))
def test_micro_batch_losses_sum_to_the_full_batch_loss(how: Aggregation) -> None:
    norm = Normaliser.of(MASK)
    parts = aggregate(VALUES[:1], MASK[:1], how, norm) + aggregate(VALUES[1:], MASK[1:], how, norm)
    assert parts.item() == pytest.approx(aggregate(VALUES, MASK, how).item())


def test_on_policy_gradient_is_minus_advantage_over_the_normaliser() -> None:
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    out = policy_loss(
        logprobs,
        logprobs.detach(),
        torch.tensor([2.0, -1.0]),
        mask,
        LossConfig(aggregation=Aggregation.TOKEN_MEAN),
    )
    torch.autograd.backward(out.loss)
    assert logprobs.grad is not None
    assert torch.allclose(logprobs.grad, torch.tensor([[-2 / 3, -2 / 3], [1 / 3, 0.0]]))
    assert out.ratio_mean == pytest.approx(1.0)
    assert out.clip_fraction == 0.0
    assert out.kl == 0.0


def test_kl_term_adds_coef_times_reduced_k3() -> None:
    logprobs = torch.tensor([[0.0, 0.0]])
    ref = torch.tensor([[math.log(0.5), 0.0]])
    mask = torch.ones(1, 2)
    config = LossConfig(aggregation=Aggregation.TOKEN_MEAN, kl_coef=0.1)
    out = policy_loss(logprobs, logprobs, torch.tensor([0.0]), mask, config, ref_logprobs=ref)
    per_token = 0.5 + math.log(2) - 1
    assert out.kl == pytest.approx(per_token / 2)
    assert out.loss.item() == pytest.approx(0.1 * per_token / 2)


def test_clip_statistics_count_only_masked_tokens() -> None:
    logprobs = torch.log(torch.tensor([[1.5, 1.0, 3.0]]))
    out = policy_loss(
        logprobs, torch.zeros(1, 3), torch.tensor([1.0]), torch.tensor([[1, 1, 0]]), LossConfig()
    )
    assert out.clip_fraction == pytest.approx(0.5)
    assert out.ratio_max == pytest.approx(1.5)
