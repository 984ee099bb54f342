"""Prompt planning, batch building, per-domain metrics and the correction of stale samples."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tether.envs.registry import Mixture
from tether.errors import ConfigError
from tether.models import load
from tether.models.dense import DenseBatch, token_logprobs
from tether.rl.learner import Learner
from tether.rl.losses import LossConfig
from tether.rl.metrics import domain_metrics, staleness
from tether.rl.rollout import Rollout, plan_prompts
from tether.rl.samples import Sample
from tether.rl.sections import AlgorithmSection, OptimSection
from tether.rl.trainer import to_samples

MIXTURE = Mixture((("a/x", 3.0), ("b/y", 1.0)))


def test_plans_are_reproducible_and_advance_per_domain_cursors() -> None:
    plans, cursors = plan_prompts(MIXTURE, {"a/x": 5}, count=40, seed=1, step=3, seed_offset=100)
    again, _ = plan_prompts(MIXTURE, {"a/x": 5}, count=40, seed=1, step=3, seed_offset=100)
    assert plans == again
    for name, start in (("a/x", 5), ("b/y", 0)):
        seeds = [p.seed for p in plans if p.env == name]
        assert seeds == list(range(100 + start, 100 + start + len(seeds)))  # each domain in order, no repeats
        assert cursors[name] == start + len(seeds)
    assert [p.group for p in plans] == list(range(40))
    assert len({p.sample_seed for p in plans}) == 40
    counts = [sum(p.env == "a/x" for p in plans), sum(p.env == "b/y" for p in plans)]
    assert counts[0] > counts[1] > 0  # drawn by weight 3 : 1


def test_different_steps_draw_different_plans() -> None:
    first, _ = plan_prompts(MIXTURE, {}, count=20, seed=1, step=0)
    second, _ = plan_prompts(MIXTURE, {}, count=20, seed=1, step=1)
    assert [p.env for p in first] != [p.env for p in second]
    assert {p.sample_seed for p in first}.isdisjoint({p.sample_seed for p in second})


def _rollout(env: str, group: int, reward: float, tokens: int = 3, finish: str = "stop") -> Rollout:
    return Rollout(
        env=env,
        seed=group,
        group=group,
        prompt_ids=[1, 2],
        completion_ids=list(range(tokens)),
        logprobs=[-0.5] * tokens,
        versions=[4] * tokens,
        finish_reason=finish,
        reward=reward,
        components={"correctness": reward},
        passed=reward == 1.0,
    )


def test_samples_carry_group_advantages_and_drop_uniform_groups() -> None:
    rollouts = [_rollout("a/x", 0, r) for r in (1.0, 0.0)] + [_rollout("a/x", 1, r) for r in (1.0, 1.0)]
    kept = to_samples(rollouts, AlgorithmSection(advantage="dr_grpo"), 2, 8)
    assert [s.advantage for s in kept.samples] == [0.5, -0.5, 0.0, 0.0]
    assert kept.samples[0].token_ids == [1, 2, 0, 1, 2] and kept.samples[0].completion_start == 2
    dropped = to_samples(rollouts, AlgorithmSection(advantage="dr_grpo", drop_equal_groups=True), 2, 8)
    assert [s.advantage for s in dropped.samples] == [0.5, -0.5]
    assert dropped.dropped_groups == 1


def test_overlong_penalty_shapes_rewards_before_advantages() -> None:
    # max 8 tokens, buffer 4: 6 tokens cost 0.5, 2 tokens nothing; equal correctness now differs.
    rollouts = [_rollout("a/x", 0, 1.0, tokens=6), _rollout("a/x", 0, 1.0, tokens=2)]
    batch = to_samples(rollouts, AlgorithmSection(advantage="dr_grpo", overlong_buffer_tokens=4), 2, 8)
    assert [s.advantage for s in batch.samples] == [-0.25, 0.25]
    assert batch.rewards_shaped_mean == pytest.approx(0.75)


def test_metrics_are_reported_overall_and_per_domain() -> None:
    rollouts = [
        _rollout("a/x", 0, 1.0, tokens=4),
        _rollout("a/x", 0, 0.0, tokens=8, finish="length"),
        _rollout("b/y", 1, 0.5, tokens=2),
    ]
    rollouts[2].sandbox_time_s = 1.5
    metrics = domain_metrics(rollouts)
    assert metrics["reward"] == pytest.approx(0.5)
    assert metrics["domain/a/x/reward"] == pytest.approx(0.5)
    assert metrics["domain/a/x/pass_rate"] == pytest.approx(0.5)
    assert metrics["domain/a/x/truncation_rate"] == pytest.approx(0.5)
    assert metrics["domain/a/x/response_tokens"] == pytest.approx(6.0)
    assert metrics["domain/b/y/reward/correctness"] == pytest.approx(0.5)
    assert metrics["domain/b/y/sandbox_s"] == pytest.approx(1.5)
    assert metrics["sandbox_s"] == pytest.approx(1.5)
    assert staleness(rollouts, policy_version=6) == {"staleness_mean": 2.0, "staleness_max": 2.0}


def test_to_samples_needs_whole_groups() -> None:
    with pytest.raises(AssertionError, match="whole groups"):
        to_samples([_rollout("a/x", 0, 1.0)], AlgorithmSection(), 2, 8)


def test_samples_of_rollouts_with_older_tokens_are_stale() -> None:
    rollouts = [_rollout("a/x", 0, 1.0), _rollout("a/x", 0, 0.0)]
    rollouts[1].versions = [4, 5, 5]
    batch = to_samples(rollouts, AlgorithmSection(), 2, 8, policy_version=5)
    assert [s.stale for s in batch.samples] == [True, True]
    assert [s.stale for s in to_samples(rollouts, AlgorithmSection(), 2, 8, policy_version=4).samples] == [
        False,
        False,
    ]
    rollouts[0].versions = [5, 5, 5]
    assert [s.stale for s in to_samples(rollouts, AlgorithmSection(), 2, 8, policy_version=5).samples] == [
        False,
        True,
    ]


def test_observation_tokens_count_neither_as_response_nor_as_stale() -> None:
    episode = _rollout("a/x", 0, 1.0, tokens=5)
    episode.loss_mask = [True, False, False, True, True]
    episode.versions = [6, -1, -1, 6, 6]
    metrics = domain_metrics([episode])
    assert metrics["response_tokens"] == 3.0
    assert staleness([episode], policy_version=6) == {"staleness_mean": 0.0, "staleness_max": 0.0}
    sample = to_samples([episode], AlgorithmSection(), 1, 8, policy_version=6).samples[0]
    assert sample.loss_mask == episode.loss_mask and not sample.stale


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"behaviour_logprobs": [-1.0]}, "behaviour_logprobs has 1 entries for 2 completion tokens"),
        ({"loss_mask": [True, False, True]}, "loss_mask has 3 entries for 2 completion tokens"),
        ({"completion_start": 4, "behaviour_logprobs": []}, "completion_start 4 must leave"),
        ({"completion_start": 0, "behaviour_logprobs": [-1.0] * 4}, "completion_start 0 must leave"),
    ],
)
def test_inconsistent_samples_are_refused(kwargs: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {
        "token_ids": [1, 2, 3, 4],
        "completion_start": 2,
        "behaviour_logprobs": [-1.0, -2.0],
        "advantage": 1.0,
    }
    with pytest.raises(ValueError, match=message):
        Sample(**{**fields, **kwargs})


def _learner(folder: Path) -> Learner:
    model, _, _ = load(folder)
    return Learner(
        model, OptimSection(max_grad_norm=1e9), LossConfig(), total_steps=1, temperature=1.0, max_new_tokens=4
    )


def test_stale_samples_are_weighted_by_truncated_importance_sampling(
    tiny_model: Callable[[str], Path],
) -> None:
    folder = tiny_model("llama")
    ids, start = [3, 4, 5, 6, 7], 2
    model, _, _ = load(folder)
    with torch.no_grad():
        (current,) = token_logprobs(model, DenseBatch.padded([ids]), [(start, len(ids))])
    # The behaviour policy gave these tokens a third of today's probability: ratio 3, capped at 2.
    older = (current - math.log(3.0)).tolist()
    stale = _learner(folder).step([Sample(ids, start, older, 1.0, stale=True)])
    fresh = _learner(folder).step([Sample(ids, start, current.tolist(), 1.0)])
    assert stale.importance_sampling == 1.0 and stale.tis_truncated == 1.0
    assert stale.ratio_min == pytest.approx(3.0, rel=1e-5) and stale.ratio_max == pytest.approx(3.0, rel=1e-5)
    assert stale.max_logprob_diff == pytest.approx(math.log(3.0), rel=1e-5)
    assert stale.grad_norm == pytest.approx(2.0 * fresh.grad_norm, rel=1e-4)  # weight min(3, 2)
    assert fresh.importance_sampling == 0.0 and fresh.max_logprob_diff == 0.0 and fresh.ratio_std == 0.0
    # Not stale, the same old logprobs go through the clipped ratio instead: 3 > 1.2, no gradient at all.
    clipped = _learner(folder).step([Sample(ids, start, older, 1.0)])
    assert clipped.grad_norm == 0.0 and clipped.clip_fraction == 1.0


@pytest.mark.parametrize("cap", [0.5, float("nan"), float("inf")])
def test_bad_tis_caps_are_refused(tiny_model: Callable[[str], Path], cap: float) -> None:
    model, _, _ = load(tiny_model("llama"))
    with pytest.raises(ConfigError, match="tis_cap"):
        Learner(model, OptimSection(), LossConfig(), 1, 1.0, 4, tis_cap=cap)
