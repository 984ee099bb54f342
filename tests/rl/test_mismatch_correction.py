"""The trainer-engine mismatch correction (`[algorithm] mismatch_correction`): every sample's gradient
weighted by its truncated importance ratio learner / engine, per token or per sequence. The weights are
the hand-computed ones and the cap truncates them, equal logprobs leave the update bit for bit
uncorrected, two FSDP ranks weigh and report exactly as one learner does, and bad settings are refused."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from tether.errors import ConfigError
from tether.models import load
from tether.models.dense import DenseBatch, token_logprobs
from tether.rl.learner import Learner
from tether.rl.losses import Correction, LossConfig, Normaliser, policy_loss, truncated_importance_weights
from tether.rl.parity import compare_with_single
from tether.rl.samples import Sample
from tether.rl.sections import OptimSection

CAP = 2.0
# Prompt + completion ids, where the completion starts, advantage: two prompts, one shared.
SHAPES = [([3, 4, 5, 6, 7], 2, 1.0), ([3, 4, 9, 8], 2, -1.0), ([11, 12, 13, 14, 5], 3, 0.5)]
# log(learner / engine) per completion token: ratios 3 (over the cap), 1.5 and 0.5.
SHIFTS = [[math.log(3.0), math.log(1.5), math.log(0.5)], [math.log(1.5), 0.0], [math.log(0.5), math.log(3.0)]]


def test_token_and_sequence_weights_are_the_truncated_ratios() -> None:
    shifts = torch.tensor([[math.log(3.0), math.log(1.5), math.log(0.5)], [math.log(1.5), 5.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # the 5.0 is an observation token: no say
    behaviour = torch.full_like(shifts, -2.0)
    logprobs = (behaviour + shifts).requires_grad_(True)
    token, token_cut = truncated_importance_weights(logprobs, behaviour, mask, Correction.TOKEN, CAP)
    assert not token.requires_grad
    assert token[0].tolist() == pytest.approx([2.0, 1.5, 0.5], rel=1e-6)
    assert token_cut.tolist() == [[True, False, False], [False, False, False]]
    assert token[1, 0].item() == pytest.approx(1.5, rel=1e-6)
    sequence, sequence_cut = truncated_importance_weights(logprobs, behaviour, mask, Correction.SEQUENCE, CAP)
    # Products over the loss tokens: 3 * 1.5 * 0.5 = 2.25, capped at 2; then 1.5 alone.
    assert sequence[0].tolist() == pytest.approx([2.0] * 3, rel=1e-6)
    assert sequence[1].tolist() == pytest.approx([1.5] * 3, rel=1e-6)
    assert sequence_cut.tolist() == [[True] * 3, [False] * 3]
    loose, loose_cut = truncated_importance_weights(logprobs, behaviour, mask, Correction.SEQUENCE, 3.0)
    assert loose[0, 0].item() == pytest.approx(2.25, rel=1e-6) and not loose_cut.any()


def _current(folder: Path) -> list[list[float]]:
    """The learner's own completion logprobs of SHAPES (a plain forward: on the CPU in float32 bit for
    bit what the learner recomputes)."""
    model, _, _ = load(folder)
    with torch.no_grad():
        logprobs = token_logprobs(
            model, DenseBatch.padded([ids for ids, _, _ in SHAPES]), [(s, len(ids)) for ids, s, _ in SHAPES]
        )
    return [lp.tolist() for lp in logprobs]


def _samples(behaviour: Sequence[Sequence[float]], advantages: Sequence[float] | None = None) -> list[Sample]:
    return [
        Sample(ids, start, list(lp), advantage if advantages is None else advantages[i])
        for i, ((ids, start, advantage), lp) in enumerate(zip(SHAPES, behaviour, strict=True))
    ]


def _learner(folder: Path, correction: Correction, micro_batch: int = 8) -> Learner:
    model, _, _ = load(folder)
    return Learner(
        model,
        OptimSection(lr=1.0, eps=1.0, micro_batch=micro_batch, max_grad_norm=1e9),
        LossConfig(),
        total_steps=1,
        temperature=1.0,
        max_new_tokens=4,
        mismatch_correction=correction,
        mismatch_cap=CAP,
    )


@pytest.mark.parametrize("correction", [Correction.TOKEN, Correction.SEQUENCE])
def test_equal_logprobs_weigh_one_and_leave_the_update_unchanged(
    tiny_model: Callable[[str], Path], correction: Correction
) -> None:
    folder = tiny_model("llama")
    samples = _samples(_current(folder))
    plain, corrected = _learner(folder, Correction.NONE), _learner(folder, correction)
    stats_plain, stats = plain.step(samples), corrected.step(samples)
    assert (
        stats.importance_sampling == 1.0 and stats.mismatch_weight_mean == 1.0 and stats.tis_truncated == 0.0
    )
    assert stats_plain.importance_sampling == 0.0 and stats_plain.mismatch_weight_mean == 1.0
    assert stats.loss == stats_plain.loss and stats.grad_norm == stats_plain.grad_norm
    for (name, a), (_, b) in zip(
        plain.model.named_parameters(), corrected.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def _hand_weights(correction: Correction) -> list[list[float]]:
    if correction is Correction.TOKEN:
        return [[min(math.exp(s), CAP) for s in row] for row in SHIFTS]
    return [[min(math.exp(sum(row)), CAP)] * len(row) for row in SHIFTS]


def _weighted_update(folder: Path, weights: list[list[float]]) -> torch.nn.Module:
    """The corrected update written out plainly: w * A * logprob with the hand weights, one AdamW step."""
    model = load(folder)[0].train().requires_grad_(True)
    width = max(len(w) for w in weights)
    logprobs = torch.stack(
        [
            torch.nn.functional.pad(lp, (0, width - len(lp)))
            for lp in token_logprobs(
                model,
                DenseBatch.padded([ids for ids, _, _ in SHAPES]),
                [(s, len(ids)) for ids, s, _ in SHAPES],
            )
        ]
    )
    mask = torch.tensor([[1.0] * len(w) + [0.0] * (width - len(w)) for w in weights])
    advantages = torch.tensor([[a] for _, _, a in SHAPES]) * torch.tensor(
        [w + [1.0] * (width - len(w)) for w in weights]
    )
    norm = Normaliser(len(SHAPES), int(mask.sum()), 4)
    torch.autograd.backward(
        policy_loss(logprobs, logprobs.detach(), advantages, mask, LossConfig(), norm).loss
    )
    torch.optim.AdamW(model.parameters(), lr=1.0, eps=1.0, weight_decay=0.0).step()
    return model


@pytest.mark.parametrize("correction", [Correction.TOKEN, Correction.SEQUENCE])
def test_a_known_mismatch_is_weighted_by_the_hand_computed_truncated_ratios(
    tiny_model: Callable[[str], Path], correction: Correction
) -> None:
    folder = tiny_model("llama")
    behaviour = [
        [lp - s for lp, s in zip(row, shift, strict=True)]
        for row, shift in zip(_current(folder), SHIFTS, strict=True)
    ]
    learner = _learner(folder, correction, micro_batch=2)  # two micro-batches: the stats add up
    stats = learner.step(_samples(behaviour))
    weights = _hand_weights(correction)
    tokens = [w for row in weights for w in row]
    exceeded = (
        [math.exp(s) > CAP for row in SHIFTS for s in row]
        if correction is Correction.TOKEN
        else [math.exp(sum(row)) > CAP for row in SHIFTS for _ in row]
    )
    assert stats.mismatch_weight_mean == pytest.approx(sum(tokens) / len(tokens), rel=1e-5)
    assert stats.tis_truncated == pytest.approx(sum(exceeded) / len(exceeded))
    assert 0 < stats.tis_truncated < 1  # the cap cut some weights, not all
    assert stats.importance_sampling == 1.0 and stats.clip_fraction == 0.0  # ratios to the learner: 1
    assert stats.max_logprob_diff == pytest.approx(math.log(3.0), rel=1e-5)
    expected = _weighted_update(folder, weights)
    for (name, a), (_, b) in zip(learner.model.named_parameters(), expected.named_parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_two_ranks_weigh_and_report_the_mismatch_as_one_learner(tiny_model: Callable[[str], Path]) -> None:
    folder = tiny_model("llama")
    behaviour = [
        [lp - s for lp, s in zip(row, shift, strict=True)]
        for row, shift in zip(_current(folder), SHIFTS, strict=True)
    ]
    result = compare_with_single(
        folder,
        optim=OptimSection(lr=1e-4, micro_batch=1),
        options={"mismatch_correction": Correction.TOKEN, "mismatch_cap": CAP},
        batches=[_samples(behaviour)] * 2,
    )
    print(result)
    assert result["fsdp2_max_abs_diff_vs_single"] < 1e-5
    assert result["fsdp2_max_stat_diff_vs_single"] < 1e-5  # mismatch_weight_mean, tis_truncated included


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"mismatch_cap": 0.5}, r"mismatch_cap = 0\.5: expected a number >= 1"),
        ({"mismatch_cap": float("nan")}, r"mismatch_cap = nan: expected a number >= 1"),
        ({"mismatch_cap": float("inf")}, r"mismatch_cap = inf: expected a number >= 1"),
        (
            {"mismatch_correction": "seq"},
            r"mismatch_correction = 'seq': expected one of none, token, sequence",
        ),
    ],
)
def test_bad_mismatch_settings_are_refused(
    tiny_model: Callable[[str], Path], settings: dict[str, object], message: str
) -> None:
    model, _, _ = load(tiny_model("llama"))
    with pytest.raises(ConfigError, match=message):
        Learner(model, OptimSection(), LossConfig(), 1, 1.0, 4, **settings)  # type: ignore[arg-type]
