"""The clipped policy-gradient objective and its reduction: pure functions over [sequences, tokens].

Per token: ratio = exp(logprob - behaviour logprob); loss = -min(ratio * A, clip(ratio, 1 - low,
1 + high) * A), plus `kl_coef` times the k3 estimate of KL(policy || reference). The behaviour logprobs
are those the engine recorded at generation time, so the same ratio is PPO's clip on-policy and the
importance correction for stale rollouts in async mode. Reductions divide by *global* counts passed in,
so summing the losses of micro-batches gives exactly the loss of the whole batch (gradient accumulation).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch


class Aggregation(StrEnum):
    TOKEN_MEAN = "token_mean"  # DAPO: every token of the batch weighs the same
    SEQUENCE_MEAN = "sequence_mean"  # GRPO: mean over each sequence's tokens, then over sequences
    SEQUENCE_SUM = "sequence_sum"  # Dr. GRPO: token sum divided by a constant (sequences * max_tokens)


@dataclass(frozen=True, slots=True)
class Normaliser:
    """Batch-wide counts a micro-batch's loss is divided by."""

    num_sequences: int
    num_tokens: int  # loss-bearing tokens in the whole batch
    max_tokens: int  # Dr. GRPO's constant length

    @classmethod
    def of(cls, mask: torch.Tensor, max_tokens: int | None = None) -> Normaliser:
        return cls(int(mask.shape[0]), int(mask.sum()), max_tokens or int(mask.shape[1]))


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(r) - r - 1 with r = ref - policy (>= 0)."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def clipped_token_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss and whether each token's ratio was clipped. `advantages`: [B] or [B, T]."""
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    ratio = torch.exp(logprobs - behaviour_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, how: Aggregation, norm: Normaliser | None = None
) -> torch.Tensor:
    """Reduce per-token `values` [B, T] over the tokens where `mask` is set, as `how` says."""
    norm = norm or Normaliser.of(mask)
    weights = mask.to(values.dtype)
    masked = values * weights
    if how is Aggregation.TOKEN_MEAN:
        return masked.sum() / max(norm.num_tokens, 1)
    if how is Aggregation.SEQUENCE_MEAN:
        per_sequence = masked.sum(dim=1) / weights.sum(dim=1).clamp(min=1)
        return per_sequence.sum() / max(norm.num_sequences, 1)
    assert how is Aggregation.SEQUENCE_SUM
    return masked.sum() / max(norm.num_sequences * norm.max_tokens, 1)


class Correction(StrEnum):
    """How a sample's gradient is weighted by its truncated importance ratio to the behaviour policy."""

    NONE = "none"
    TOKEN = "token"  # each token by min(its ratio, cap): token-level TIS
    SEQUENCE = "sequence"  # every token by min(the product of the loss tokens' ratios, cap)


def truncated_importance_weights(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: Correction,
    cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached importance weights [B, T] of `logprobs` over `behaviour_logprobs` at `level`, truncated
    above at `cap` (no lower bound), and which of them were truncated.

    The semantics of verl's rollout correction (`rollout_is_level` token / sequence with
    `rollout_is_mode = "truncate"`, docs/advance/rollout_is.md) and slime's TIS (`compute_tis_weights`:
    exp(train - rollout logprobs) clamped at `tis_clip`): token level is each token's ratio; sequence
    level is the product over the completion's loss tokens, exp of the summed log-ratio, so one weight
    per sequence. Tokens outside `mask` contribute log-ratio 0 (weight 1), so an observation token's
    placeholder logprob can neither overflow nor enter a sequence's product."""
    log_ratio = torch.where(mask.bool(), logprobs.detach() - behaviour_logprobs, 0.0)
    if level is Correction.SEQUENCE:
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio)
    else:
        assert level is Correction.TOKEN, level
    ratio = log_ratio.exp()
    return ratio.clamp(max=cap), ratio > cap


@dataclass(frozen=True, slots=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2  # DAPO's clip-higher: e.g. 0.28
    aggregation: Aggregation = Aggregation.SEQUENCE_MEAN
    kl_coef: float = 0.0


@dataclass(frozen=True, slots=True)
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    policy_loss: float
    kl: float  # mean per-token k3 KL over masked tokens (0 without a reference)
    clip_fraction: float  # share of masked tokens whose ratio was clipped
    ratio_mean: float
    ratio_max: float


def policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    norm: Normaliser | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> LossOutput:
    """The full objective for one (micro-)batch; every tensor is [B, T] except `advantages` ([B] ok)."""
    norm = norm or Normaliser.of(mask)
    token_loss, was_clipped = clipped_token_loss(
        logprobs, behaviour_logprobs, advantages, config.clip_low, config.clip_high
    )
    pg = aggregate(token_loss, mask, config.aggregation, norm)
    loss = pg
    kl_value = 0.0
    bool_mask = mask.bool()
    count = max(int(bool_mask.sum()), 1)
    if ref_logprobs is not None and config.kl_coef > 0:
        kl = k3_kl(logprobs, ref_logprobs)
        loss = loss + config.kl_coef * aggregate(kl, mask, config.aggregation, norm)
        kl_value = float(kl.detach()[bool_mask].sum()) / count
    with torch.no_grad():
        ratio = torch.exp(logprobs - behaviour_logprobs)[bool_mask]
    return LossOutput(
        loss=loss,
        policy_loss=float(pg.detach()),
        kl=kl_value,
        clip_fraction=float(was_clipped[bool_mask].sum()) / count,
        ratio_mean=float(ratio.mean()) if ratio.numel() else 1.0,
        ratio_max=float(ratio.max()) if ratio.numel() else 1.0,
    )
