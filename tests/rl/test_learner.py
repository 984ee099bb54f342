"""The learner on a tiny model: accumulation equals one big batch, KL to a reference, bad settings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tether.errors import ConfigError
from tether.models import load
from tether.rl.config import OptimSection
from tether.rl.learner import Learner, Sample
from tether.rl.losses import Aggregation, LossConfig

SAMPLES = [
    Sample([3, 4, 5, 6, 7], 2, [-4.0, -5.0, -4.5], 1.0),
    Sample([3, 9, 8], 1, [-5.2, -5.1], -0.5),
    Sample([11, 12, 13, 14], 3, [-4.9], 0.25),
]


def _learner(
    folder: Path, micro_batch: int, kl_coef: float = 0.0, how: Aggregation = Aggregation.TOKEN_MEAN
) -> Learner:
    # eps = 1 keeps Adam's first update ~ lr * gradient: float noise in near-zero gradients stays noise
    # instead of being normalised up to a full lr-sized step (which would hide a real mismatch).
    model, _, _ = load(folder)
    reference = load(folder)[0] if kl_coef > 0 else None
    return Learner(
        model,
        OptimSection(lr=1.0, eps=1.0, micro_batch=micro_batch),
        LossConfig(aggregation=how, kl_coef=kl_coef),
        total_steps=4,
        temperature=1.0,
        max_new_tokens=4,
        reference=reference,
    )


@pytest.mark.parametrize("how", [Aggregation.TOKEN_MEAN, Aggregation.SEQUENCE_MEAN])
def test_micro_batches_accumulate_to_the_full_batch_update(
    tiny_model: Callable[[str], Path], how: Aggregation
) -> None:
    whole, pieces = _learner(tiny_model("llama"), 8, how=how), _learner(tiny_model("llama"), 1, how=how)
    stats_whole, stats_pieces = whole.step(SAMPLES), pieces.step(SAMPLES)
    assert stats_whole.loss == pytest.approx(stats_pieces.loss, abs=1e-6)
    assert stats_whole.grad_norm == pytest.approx(stats_pieces.grad_norm, rel=1e-5)
    assert stats_whole.tokens == 6
    for (name, a), (_, b) in zip(
        whole.model.named_parameters(), pieces.model.named_parameters(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-6), name


def test_kl_to_the_reference_starts_at_zero_then_grows(tiny_model: Callable[[str], Path]) -> None:
    learner = _learner(tiny_model("llama"), 8, kl_coef=0.1)
    first = learner.step(SAMPLES)
    second = learner.step(SAMPLES)
    assert first.kl == pytest.approx(0.0, abs=1e-7)
    assert second.kl > 1e-6
    assert learner.reference is not None
    assert all(not p.requires_grad for p in learner.reference.parameters())


def test_bf16_without_a_bf16_device_is_refused(tiny_model: Callable[[str], Path]) -> None:
    model, _, _ = load(tiny_model("llama"))
    with pytest.raises(ConfigError, match=r"model\.bf16 = true needs a CUDA device"):
        Learner(
            model, OptimSection(), LossConfig(), total_steps=1, temperature=1.0, max_new_tokens=4, bf16=True
        )
