"""Prompt planning, batch building and per-domain metrics: the pure parts around the engine."""

from __future__ import annotations

import pytest

from tether.envs.registry import Mixture
from tether.rl.config import AlgorithmSection
from tether.rl.metrics import domain_metrics, staleness
from tether.rl.rollout import Rollout, plan_prompts
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
