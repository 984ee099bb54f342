"""Group-relative advantages and reward shaping: pure functions over [groups, samples] reward tensors.

A group is the n samples drawn for one prompt. GRPO normalises each reward by its group's mean and
standard deviation; Dr. GRPO only subtracts the mean; RLOO subtracts the mean of the *other* samples.
DAPO's dynamic sampling drops groups whose rewards are all equal (they carry no signal), and its
overlong penalty shapes rewards by completion length. Nothing here touches a model or a token.
"""

from __future__ import annotations

from collections.abc import Callable
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
