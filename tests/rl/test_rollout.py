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
from tether.rl.metrics import add_counters, domain_metrics, staleness
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


def _failed(env: str, group: int, reason: str, reward: float = 0.0) -> Rollout:
    rollout = _rollout(env, group, reward)
    rollout.infra_failure, rollout.error = reason, f"InfraError: {reason}"
    return rollout


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo"])
def test_an_infra_failed_sample_never_reaches_the_advantages(advantage: str) -> None:
    rewards = [1.0, 0.0, 0.25, 1.0]
    with_failure = [_rollout("a/x", 0, r) for r in rewards]
    with_failure.insert(2, _failed("a/x", 0, "sandbox_error"))
    without = [_rollout("a/x", 0, r) for r in rewards]
    algorithm = AlgorithmSection(advantage=advantage)
    failed_batch = to_samples(with_failure, algorithm, 5, 8)
    clean_batch = to_samples(without, algorithm, 4, 8)
    # The other samples get exactly the advantages of the group without it; it is no sample at all.
    assert [s.advantage for s in failed_batch.samples] == [s.advantage for s in clean_batch.samples]
    assert len(failed_batch.samples) == 4 and failed_batch.short_groups == 0
    assert failed_batch.rewards_shaped_mean == clean_batch.rewards_shaped_mean


def test_a_group_left_with_too_few_scored_samples_is_dropped() -> None:
    rollouts = [_rollout("a/x", 0, 1.0), _failed("a/x", 0, "scorer_timeout"), _failed("a/x", 0, "sandbox_qc")]
    rollouts += [_rollout("a/x", 1, r) for r in (1.0, 0.0, 0.5)]
    batch = to_samples(rollouts, AlgorithmSection(min_group_samples=2), 3, 8)
    assert batch.short_groups == 1 and len(batch.samples) == 3
    # A group of one sample per prompt keeps its one scored sample (min_group_samples is capped at n).
    lone = to_samples([_rollout("a/x", 0, 1.0), _failed("a/x", 1, "sandbox_error")], AlgorithmSection(), 1, 8)
    assert lone.short_groups == 1 and len(lone.samples) == 1


def test_dapo_filtering_and_overlong_penalty_see_only_scored_samples() -> None:
    rollouts = [_rollout("a/x", 0, 1.0), _rollout("a/x", 0, 1.0), _failed("a/x", 0, "scorer_error")]
    algorithm = AlgorithmSection(drop_equal_groups=True, overlong_buffer_tokens=4)
    batch = to_samples(rollouts, algorithm, 3, 8)
    assert batch.dropped_groups == 1 and not batch.samples
    assert batch.rewards_shaped_mean == pytest.approx(1.0)  # 3 tokens of 8: no penalty; failed one unread


def test_a_nan_reward_of_a_scored_rollout_is_refused_not_summed_as_zero() -> None:
    rollouts = [_rollout("a/x", 0, 1.0), _rollout("a/x", 0, math.nan)]
    with pytest.raises(AssertionError, match="finite reward"):
        to_samples(rollouts, AlgorithmSection(), 2, 8)
    rollouts[1].infra_failure = "invalid_reward"  # as scoring marks it: then it is left out
    assert len(to_samples(rollouts, AlgorithmSection(min_group_samples=1), 2, 8).samples) == 1


def test_metrics_count_infra_failures_and_retries_and_average_rewards_over_scored_rollouts() -> None:
    rollouts = [_rollout("a/x", 0, 1.0), _failed("a/x", 0, "sandbox_error"), _rollout("b/y", 1, 0.5)]
    rollouts[0].retry_reasons = ["sandbox_error"]
    rollouts[1].retry_reasons = ["sandbox_error", "scorer_timeout"]
    metrics = domain_metrics(rollouts)
    assert metrics["reward"] == pytest.approx(0.75) and metrics["domain/a/x/reward"] == 1.0
    assert metrics["rollout/infra_failed"] == 1 and metrics["rollout/infra_failed/sandbox_error"] == 1
    assert metrics["domain/a/x/rollout/infra_failed"] == 1 and metrics["domain/b/y/rollout/infra_failed"] == 0
    assert metrics["rollout/infra_failure_rate"] == pytest.approx(1 / 3)
    assert metrics["rollout/retried"] == 3
    assert metrics["rollout/retried/sandbox_error"] == 2 and metrics["rollout/retried/scorer_timeout"] == 1
    # A source's own counters add up with the rollouts' counts; the total stays the sum of its reasons.
    add_counters(metrics, {"rollout/retried/worker_lost": 2.0, "rollout/workers_replaced": 1.0})
    assert metrics["rollout/retried"] == 5 and metrics["rollout/workers_replaced"] == 1


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
