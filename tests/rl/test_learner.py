"""The learner on a tiny model: accumulation equals one big batch, prompts shared within a row and
zero-advantage samples skipped without changing the update, KL to a reference."""

from __future__ import annotations

import platform
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.memory_maps import mapped_file, needs_proc_maps
from tether.models import load
from tether.models.dense import DenseBatch, token_logprobs
from tether.rl.learner import Learner
from tether.rl.losses import Aggregation, LossConfig, Normaliser, policy_loss
from tether.rl.samples import Sample
from tether.rl.sections import OptimSection

SAMPLES = [
    Sample([3, 4, 5, 6, 7], 2, [-4.0, -5.0, -4.5], 1.0),
    Sample([3, 9, 8], 1, [-5.2, -5.1], -0.5),
    Sample([11, 12, 13, 14], 3, [-4.9], 0.25),
]
# Two prompts with several samples each, two of them with advantage 0 (all-equal groups look like that).
SHARED = [
    Sample([3, 4, 5, 6, 7], 2, [-4.0, -5.0, -4.5], 1.0),
    Sample([11, 12, 13, 14], 3, [-4.9], 0.5),
    Sample([3, 4, 9, 8], 2, [-5.2, -5.1], -1.0),
    Sample([3, 4, 12], 2, [-4.9], 0.0),
    Sample([11, 12, 13, 7, 7], 3, [-4.0, -4.2], 0.0),
    Sample([3, 4, 6], 2, [-4.4], 0.5),
]


def _learner(
    folder: Path,
    micro_batch: int,
    kl_coef: float = 0.0,
    how: Aggregation = Aggregation.TOKEN_MEAN,
    micro_batch_tokens: int | None = None,
) -> Learner:
    # eps = 1 keeps Adam's first update ~ lr * gradient: float noise in near-zero gradients stays noise
    # instead of being normalised up to a full lr-sized step (which would hide a real mismatch).
    model, _, _ = load(folder)
    reference = load(folder)[0] if kl_coef > 0 else None
    return Learner(
        model,
        OptimSection(lr=1.0, eps=1.0, micro_batch=micro_batch, micro_batch_tokens=micro_batch_tokens),
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


def _reference_update(folder: Path, samples: list[Sample], how: Aggregation) -> torch.nn.Module:
    """The update written out plainly: every sample padded in its own row, one loss, one AdamW step."""
    model = load(folder)[0].train().requires_grad_(True)
    width = max(len(s.behaviour_logprobs) for s in samples)

    def rows(values: list[list[float]]) -> torch.Tensor:
        return torch.tensor([v + [0.0] * (width - len(v)) for v in values])

    batch = DenseBatch.padded([s.token_ids for s in samples])
    targets = [(s.completion_start, len(s.token_ids)) for s in samples]
    logprobs = torch.stack(
        [torch.nn.functional.pad(lp, (0, width - len(lp))) for lp in token_logprobs(model, batch, targets)]
    )
    mask = rows([[1.0] * len(s.behaviour_logprobs) for s in samples])
    norm = Normaliser(len(samples), int(mask.sum()), 4)
    advantages = torch.tensor([s.advantage for s in samples])
    behaviour = rows([s.behaviour_logprobs for s in samples])
    loss = policy_loss(logprobs, behaviour, advantages, mask, LossConfig(aggregation=how), norm).loss
    torch.autograd.backward(loss)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.AdamW(model.parameters(), lr=1.0, eps=1.0, weight_decay=0.0).step()
    return model


@pytest.mark.parametrize("how", list(Aggregation))
def test_shared_prompts_and_skipped_samples_give_the_plain_update(
    tiny_model: Callable[[str], Path], how: Aggregation
) -> None:
    learner = _learner(tiny_model("llama"), 8, how=how)
    stats = learner.step(SHARED)
    assert stats.skipped_sequences == 2
    assert stats.tokens == 10
    expected = _reference_update(tiny_model("llama"), SHARED, how)
    for (name, a), (_, b) in zip(learner.model.named_parameters(), expected.named_parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_a_step_with_every_sample_skipped_still_steps_the_optimizer(
    tiny_model: Callable[[str], Path],
) -> None:
    learner = _learner(tiny_model("llama"), 8)
    learner.step(SAMPLES)
    before = [p.detach().clone() for p in learner.model.parameters()]
    stats = learner.step(
        [Sample(s.token_ids, s.completion_start, s.behaviour_logprobs, 0.0) for s in SAMPLES]
    )
    assert stats.skipped_sequences == len(SAMPLES)
    assert stats.grad_norm == 0.0
    # AdamW's moments from the first step keep moving the weights, as with a computed zero gradient.
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.model.parameters(), strict=True))


def test_a_step_reports_the_seconds_of_its_forward_backward_and_optimizer(
    tiny_model: Callable[[str], Path],
) -> None:
    learner = _learner(tiny_model("llama"), 1)  # three micro-batches: their seconds add up
    stats = learner.step(SAMPLES)
    assert stats.forward_s > 0 and stats.backward_s > 0 and stats.optimizer_s > 0
    assert {"time/forward_s", "time/backward_s", "time/optimizer_s"} <= set(stats.to_dict())
    skipped = learner.step(
        [Sample(s.token_ids, s.completion_start, s.behaviour_logprobs, 0.0) for s in SAMPLES]
    )
    assert skipped.forward_s == 0.0 and skipped.backward_s == 0.0 and skipped.optimizer_s > 0


def test_adamws_state_is_allocated_with_the_learner_and_steps_as_torchs_own(
    tiny_model: Callable[[str], Path],
) -> None:
    eager, lazy = _learner(tiny_model("llama"), 8), _learner(tiny_model("llama"), 8)
    params = list(eager.model.parameters())
    assert all(set(eager.optimizer.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in params)
    lazy.optimizer.state.clear()  # what torch's AdamW starts from: its first step allocates the state
    for _ in range(2):
        eager.step(SAMPLES)
        lazy.step(SAMPLES)
    for a, b in zip(params, lazy.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_token_budget_gives_the_same_update(tiny_model: Callable[[str], Path]) -> None:
    whole = _learner(tiny_model("llama"), 8)
    budgeted = _learner(tiny_model("llama"), 8, micro_batch_tokens=6)
    stats_whole, stats_budgeted = whole.step(SHARED), budgeted.step(SHARED)
    assert stats_whole.loss == pytest.approx(stats_budgeted.loss, abs=1e-6)
    assert stats_whole.max_logprob_diff == stats_budgeted.max_logprob_diff
    for (name, a), (_, b) in zip(
        whole.model.named_parameters(), budgeted.model.named_parameters(), strict=True
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


@needs_proc_maps
def test_the_trained_weights_are_the_learners_own_memory_not_the_checkpoints_file_mapping(
    tiny_model: Callable[[str], Path],
) -> None:
    folder = tiny_model("llama")
    loaded, _, _ = load(folder)
    mapped = {name: mapped_file(p.data_ptr()) for name, p in loaded.named_parameters()}
    assert any(path.endswith(".safetensors") for path in mapped.values())  # what load gives
    learner = Learner(
        loaded, OptimSection(lr=1.0, eps=1.0), LossConfig(), total_steps=1, temperature=1.0, max_new_tokens=4
    )
    assert learner.keeps_freed_memory is (platform.libc_ver()[0] == "glibc")  # on the CPU (`host_heap`)
    owned = {name: mapped_file(p.data_ptr()) for name, p in learner.model.named_parameters()}
    assert not [name for name, path in owned.items() if path.endswith(".safetensors")]
    reference, _, _ = load(folder)
    learner.step(SAMPLES)  # trains as before: the first step moves every weight
    for (name, a), (_, b) in zip(learner.model.named_parameters(), reference.named_parameters(), strict=True):
        assert not torch.equal(a, b), name
