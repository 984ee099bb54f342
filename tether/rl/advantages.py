"""Group-relative advantages and reward shaping: pure functions over [groups, samples] reward tensors.

A group is the n samples drawn for one prompt. GRPO normalises each reward by its group's mean and
standard deviation; Dr. GRPO only subtracts the mean; RLOO subtracts the mean of the *other* samples.
DAPO's dynamic sampling drops groups whose rewards are all equal (they carry no signal), and its
overlong penalty shapes rewards by completion length. `group_advantages` computes them over the valid
members of each group only (a sample that could not be scored is no member), dropping a group with too
few of them. Nothing here touches a model or a token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import torch

from tether.errors import ConfigError

AdvantageFn = Callable[[torch.Tensor], torch.Tensor]


class AdvantageKind(StrEnum):
    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    RLOO = "rloo"


def _check(rewards: torch.Tensor, min_samples: int = 1) -> None:
    if rewards.ndim != 2 or rewards.shape[1] < min_samples:
        raise ConfigError(
            f"rewards of shape {tuple(rewards.shape)}: "
            f"expected [groups, samples] with >= {min_samples} samples"
        )


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(r - group mean) / (group std + eps), with the unbiased std (as in DeepSeekMath and TRL).

    A group of one sample, or one whose rewards are all equal, gets advantage 0."""
    _check(rewards)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if rewards.shape[1] == 1:
        return torch.zeros_like(rewards)
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """r - group mean: Dr. GRPO drops the std division, which over-weights near-uniform groups."""
    _check(rewards)
    return rewards - rewards.mean(dim=1, keepdim=True)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """r_i - mean of the other n - 1 rewards of its group (leave-one-out baseline); needs n >= 2."""
    _check(rewards, min_samples=2)
    n = rewards.shape[1]
    others = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)
    return rewards - others


ADVANTAGES: dict[AdvantageKind, AdvantageFn] = {
    AdvantageKind.GRPO: grpo_advantages,
    AdvantageKind.DR_GRPO: dr_grpo_advantages,
    AdvantageKind.RLOO: rloo_advantages,
}


def compute_advantages(kind: AdvantageKind, rewards: torch.Tensor) -> torch.Tensor:
    return ADVANTAGES[kind](rewards)


# The fewest samples each kind of advantage needs in a group (RLOO's baseline is the other samples).
MIN_SAMPLES: dict[AdvantageKind, int] = {AdvantageKind.RLOO: 2}


@dataclass(frozen=True, slots=True)
class GroupAdvantages:
    """Advantages of a [groups, samples] batch in which some samples are not valid members."""

    advantages: torch.Tensor  # [groups, samples]: 0.0 for invalid samples and in dropped groups
    kept: torch.Tensor  # BoolTensor[groups]: groups to train on
    too_few: int  # groups dropped for having fewer valid samples than asked
    uninformative: int  # groups dropped because their valid samples' rewards were all equal


def group_advantages(
    kind: AdvantageKind,
    rewards: torch.Tensor,
    valid: torch.Tensor,
    min_samples: int = 1,
    drop_equal: bool = False,
) -> GroupAdvantages:
    """Each group's advantages computed over its `valid` members alone, exactly as for a group of only
    them; the rewards of invalid samples are never read (they may be NaN). A group with fewer than
    `min_samples` valid members (or than its kind needs) is dropped, and with `drop_equal` so is one
    whose valid rewards are all equal."""
    _check(rewards)
    if valid.shape != rewards.shape or valid.dtype != torch.bool:
        raise ConfigError(f"valid mask of shape {tuple(valid.shape)}: expected a BoolTensor like the rewards")
    needed = max(min_samples, MIN_SAMPLES.get(kind, 1))
    advantages = torch.zeros_like(rewards)
    kept = torch.zeros(rewards.shape[0], dtype=torch.bool)
    too_few = uninformative = 0
    for group in range(rewards.shape[0]):
        members = rewards[group, valid[group]].unsqueeze(0)
        if members.shape[1] < needed:
            too_few += 1
        elif drop_equal and not bool(informative_groups(members)[0]):
            uninformative += 1
        else:
            kept[group] = True
            advantages[group, valid[group]] = ADVANTAGES[kind](members)[0]
    return GroupAdvantages(advantages, kept, too_few, uninformative)


def informative_groups(rewards: torch.Tensor, atol: float = 1e-9) -> torch.Tensor:
    """BoolTensor[groups]: groups whose rewards are not all equal (DAPO dynamic sampling keeps these)."""
    _check(rewards)
    spread = rewards.max(dim=1).values - rewards.min(dim=1).values
    return spread > atol


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer_tokens: int) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward of each completion of `lengths` tokens.

    0 up to `max_tokens - buffer_tokens`; then falling linearly to -1 at `max_tokens`; -1 beyond it."""
    if not 0 < buffer_tokens <= max_tokens:
        raise ConfigError(
            f"overlong buffer_tokens = {buffer_tokens}: expected 1 to max_tokens ({max_tokens})"
        )
    free = max_tokens - buffer_tokens
    over = (lengths.to(torch.float64) - free).clamp(min=0)
    return (-over / buffer_tokens).clamp(min=-1.0).to(torch.float32)
