"""The learner: one optimizer update from a batch of scored rollouts, on our own `CausalLM`.

Logprobs are recomputed with the dense training forward (`tether.models.dense`) over prompt + completion
token ids as generated, at the rollout temperature, so on-policy ratios start at exactly 1. The batch is
split into micro-batches whose losses are normalised by batch-wide counts (gradient accumulation gives
the full-batch gradient), then clipped, stepped with AdamW and the LR schedule. The learner knows nothing
of engines or environments; `weights()` is what gets pushed to the rollout engine.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from tether.errors import ConfigError
from tether.models.dense import DenseBatch, token_logprobs
from tether.models.transformer import CausalLM
from tether.rl.config import OptimSection, Schedule
from tether.rl.losses import LossConfig, Normaliser, policy_loss


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: Schedule) -> float:
    """Factor on the peak LR for update `step` (0-based): linear warm-up, then the schedule's decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule is Schedule.CONSTANT:
        return 1.0
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    if schedule is Schedule.LINEAR:
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True, slots=True)
class Sample:
    """One sequence to learn from: its ids, where the completion starts, and what the loss needs."""

    token_ids: list[int]  # prompt + completion
    completion_start: int
    behaviour_logprobs: list[float]  # one per completion token
    advantage: float
    loss_mask: list[bool] | None = None  # per completion token; None: every token (single-turn)


@dataclass(frozen=True, slots=True)
class LearnStats:
    loss: float
    policy_loss: float
    kl: float
    clip_fraction: float
    ratio_mean: float
    ratio_max: float
    grad_norm: float
    lr: float
    tokens: int

    def to_dict(self, prefix: str = "learner/") -> dict[str, float]:
        return {f"{prefix}{name}": float(getattr(self, name)) for name in self.__slots__}


def _padded(rows: Sequence[Sequence[float]], width: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(list(row), dtype=torch.float32)
    return out.to(device)


class Learner:
    def __init__(
        self,
        model: CausalLM,
        optim: OptimSection,
        loss: LossConfig,
        total_steps: int,
        temperature: float,
        max_new_tokens: int,
        reference: CausalLM | None = None,
        bf16: bool = False,
    ) -> None:
        self.model = model.train().requires_grad_(True)
        self.config = optim
        self.loss_config = loss
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.reference = reference.eval().requires_grad_(False) if reference is not None else None
        self.device = next(model.parameters()).device
        if bf16 and not (self.device.type == "cuda" and torch.cuda.is_bf16_supported()):
            raise ConfigError(
                f"model.bf16 = true needs a CUDA device with bfloat16; the learner is on {self.device}"
            )
        self.bf16 = bf16
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_multiplier(step, optim.warmup_steps, total_steps, optim.schedule),
        )

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _logprobs(self, model: CausalLM, samples: Sequence[Sample]) -> list[torch.Tensor]:
        batch = DenseBatch.padded([s.token_ids for s in samples]).to(self.device)
        targets = [(s.completion_start, len(s.token_ids)) for s in samples]
        with self._autocast():
            return token_logprobs(model, batch, targets, self.temperature)

    def step(self, samples: Sequence[Sample]) -> LearnStats:
        """One optimizer update over every sample (accumulated over micro-batches)."""
        assert samples, "the learner needs at least one sample"
        masks = [s.loss_mask or [True] * len(s.behaviour_logprobs) for s in samples]
        norm = Normaliser(len(samples), sum(sum(m) for m in masks), self.max_new_tokens)
        self.optimizer.zero_grad(set_to_none=True)
        totals = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "clip": 0.0, "ratio": 0.0}
        ratio_max = 0.0
        size = self.config.micro_batch
        for start in range(0, len(samples), size):
            chunk, chunk_masks = samples[start : start + size], masks[start : start + size]
            width = max(len(s.behaviour_logprobs) for s in chunk)
            logprobs = torch.stack(
                [
                    torch.nn.functional.pad(lp, (0, width - len(lp)))
                    for lp in self._logprobs(self.model, chunk)
                ]
            )
            mask = _padded([[float(x) for x in m] for m in chunk_masks], width, self.device)
            behaviour = _padded([s.behaviour_logprobs for s in chunk], width, self.device)
            advantages = torch.tensor([s.advantage for s in chunk], dtype=torch.float32, device=self.device)
            reference = None
            if self.reference is not None and self.loss_config.kl_coef > 0:
                with torch.no_grad():
                    reference = torch.stack(
                        [
                            torch.nn.functional.pad(lp, (0, width - len(lp)))
                            for lp in self._logprobs(self.reference, chunk)
                        ]
                    )
            out = policy_loss(logprobs, behaviour, advantages, mask, self.loss_config, norm, reference)
            torch.autograd.backward(out.loss)
            share = float(mask.sum()) / max(norm.num_tokens, 1)  # token-weighted share of the batch stats
            totals["loss"] += float(out.loss.detach())
            totals["policy_loss"] += out.policy_loss
            totals["kl"] += out.kl * share
            totals["clip"] += out.clip_fraction * share
            totals["ratio"] += out.ratio_mean * share
            ratio_max = max(ratio_max, out.ratio_max)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return LearnStats(
            loss=totals["loss"],
            policy_loss=totals["policy_loss"],
            kl=totals["kl"],
            clip_fraction=totals["clip"],
            ratio_mean=totals["ratio"],
            ratio_max=ratio_max,
            grad_norm=float(grad_norm),
            lr=float(lr),
            tokens=norm.num_tokens,
        )

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters to push to a rollout engine (names equal the engine model's)."""
        for name, param in self.model.named_parameters():
            yield name, param.detach()
