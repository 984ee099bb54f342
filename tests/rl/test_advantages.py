"""Advantages and reward shaping against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from tether.errors import ConfigError
from tether.rl.advantages import (
    AdvantageKind,
    compute_advantages,
    dr_grpo_advantages,
    group_advantages,
    grpo_advantages,
    informative_groups,
    overlong_penalty,
    rloo_advantages,
)


def test_grpo_divides_by_the_unbiased_group_std() -> None:
    # mean 0.5, unbiased std sqrt(1/3): advantages +-0.5 * sqrt(3) = +-sqrt(3)/2
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), eps=0.0)
    half_root3 = math.sqrt(3) / 2
    assert torch.allclose(adv, torch.tensor([[half_root3, -half_root3, -half_root3, half_root3]]))


def test_grpo_gives_zero_to_uniform_groups_and_single_samples() -> None:
    assert torch.equal(grpo_advantages(torch.tensor([[0.7, 0.7, 0.7]])), torch.zeros(1, 3))
    assert torch.equal(grpo_advantages(torch.tensor([[1.0], [0.0]])), torch.zeros(2, 1))


def test_groups_are_normalised_independently() -> None:
    adv = dr_grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 4.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[0.75, -0.25, -0.25, -0.25], [0.0, 0.0, 2.0, -2.0]]))


def test_rloo_subtracts_the_mean_of_the_other_samples() -> None:
    adv = rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]]))


def test_rloo_needs_two_samples() -> None:
    with pytest.raises(ConfigError, match=r"\[groups, samples\] with >= 2 samples"):
        rloo_advantages(torch.tensor([[1.0]]))


@pytest.mark.parametrize("shape", [(4,), (2, 2, 2)])
def test_rewards_must_be_groups_by_samples(shape: tuple[int, ...]) -> None:
    with pytest.raises(ConfigError, match="expected \\[groups, samples\\]"):
        grpo_advantages(torch.zeros(shape))


def test_compute_advantages_dispatches_by_kind() -> None:
    rewards = torch.tensor([[1.0, 0.0]])
    assert torch.allclose(compute_advantages(AdvantageKind.RLOO, rewards), torch.tensor([[1.0, -1.0]]))
    assert torch.allclose(compute_advantages(AdvantageKind.DR_GRPO, rewards), torch.tensor([[0.5, -0.5]]))


def test_dynamic_sampling_keeps_only_groups_with_a_reward_spread() -> None:
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.2, 0.2, 0.3]])
    assert informative_groups(rewards).tolist() == [False, True, False, True]


def test_overlong_penalty_is_zero_then_linear_then_minus_one() -> None:
    lengths = torch.tensor([5, 6, 8, 10, 12])
    penalty = overlong_penalty(lengths, max_tokens=10, buffer_tokens=4)
    assert torch.allclose(penalty, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))


@pytest.mark.parametrize("buffer", [0, -1, 11])
def test_overlong_buffer_must_fit_the_budget(buffer: int) -> None:
    with pytest.raises(ConfigError, match=f"buffer_tokens = {buffer}"):
        overlong_penalty(torch.tensor([1]), max_tokens=10, buffer_tokens=buffer)


@pytest.mark.parametrize("kind", list(AdvantageKind))
def test_a_group_is_normalised_over_its_valid_members_exactly_as_without_the_others(
    kind: AdvantageKind,
) -> None:
    rewards = torch.tensor([[1.0, math.nan, 0.0, 0.25], [0.5, 1.0, 0.0, 0.0]])  # NaN: never read
    valid = torch.tensor([[True, False, True, True], [True, True, True, True]])
    grouped = group_advantages(kind, rewards, valid, min_samples=2)
    alone = compute_advantages(kind, torch.tensor([[1.0, 0.0, 0.25]]))
    assert torch.equal(grouped.advantages[0, valid[0]], alone[0])
    assert grouped.advantages[0, 1] == 0.0
    assert torch.equal(grouped.advantages[1], compute_advantages(kind, rewards[1:])[0])
    assert grouped.kept.tolist() == [True, True] and grouped.too_few == grouped.uninformative == 0


def test_a_group_with_fewer_valid_members_than_asked_is_dropped() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.5], [0.0, 0.0, 0.0]])
    valid = torch.tensor([[True, False, False], [True, True, False], [False, False, False]])
    grouped = group_advantages(AdvantageKind.GRPO, rewards, valid, min_samples=2)
    assert grouped.kept.tolist() == [False, True, False] and grouped.too_few == 2
    assert torch.equal(grouped.advantages[0], torch.zeros(3))
    # RLOO needs two members whatever is asked; GRPO takes a lone one (advantage 0).
    assert group_advantages(AdvantageKind.RLOO, rewards, valid, min_samples=1).kept.tolist() == [
        False,
        True,
        False,
    ]
    assert group_advantages(AdvantageKind.GRPO, rewards, valid, min_samples=1).kept.tolist() == [
        True,
        True,
        False,
    ]


def test_dropping_equal_groups_looks_at_valid_members_only() -> None:
    # Group 0's valid rewards are all 1.0 (the failed sample's 0.0 would have made it look informative).
    rewards = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    valid = torch.tensor([[True, True, False], [True, True, True]])
    grouped = group_advantages(AdvantageKind.GRPO, rewards, valid, min_samples=2, drop_equal=True)
    assert grouped.kept.tolist() == [False, True] and grouped.uninformative == 1 and grouped.too_few == 0


def test_the_validity_mask_must_match_the_rewards() -> None:
    with pytest.raises(ConfigError, match="valid mask of shape"):
        group_advantages(AdvantageKind.GRPO, torch.zeros(2, 3), torch.ones(2, 2, dtype=torch.bool))
