"""Failures that are not rewards: scoring that fails is named, retried, then marked, and never scored."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import pytest

from tether.envs.context import ScoringContext
from tether.envs.episode import Environment
from tether.envs.registry import EnvRegistry
from tether.envs.scoring import RewardInput, Score
from tether.errors import InfraError, InfraReason
from tether.rl.metrics import domain_metrics
from tether.rl.retries import InfraFailureRateError, RetryPolicy, check_failure_rate, retry_scoring
from tether.rl.rollout import Rollout, score_groups

from .fake_envs import reward_env

RewardBody = Callable[[RewardInput, int], object]


def _env(name: str, body: RewardBody) -> tuple[Environment, list[int]]:
    """An environment whose one reward is `body(inp, call number)`; the list counts its calls."""
    calls = [0]

    async def reward(inp: RewardInput) -> float:
        calls[0] += 1
        value = body(inp, calls[0])
        if asyncio.iscoroutine(value):
            value = await value
        return value  # type: ignore[return-value]

    return reward_env(name, reward), calls


def _score(body: RewardBody, policy: RetryPolicy = RetryPolicy()) -> tuple[Rollout, int]:
    env, calls = _env("test/body", body)
    registry = EnvRegistry()
    registry.add(env)
    task = env.task(0)
    rollout = Rollout("test/body", 0, 0, [1], [2], [-0.1], [0], "stop", text="answer")
    asyncio.run(score_groups(registry, [task], [rollout], ScoringContext(), policy))
    return rollout, calls[0]


def test_a_nan_reward_is_an_invalid_reward_retried_and_never_summed_as_zero() -> None:
    rollout, calls = _score(lambda _inp, _n: math.nan)
    assert rollout.infra_failure == "invalid_reward" and calls == 3  # the try and its two retries
    assert rollout.retry_reasons == ["invalid_reward", "invalid_reward"] and rollout.retries == 2
    assert "returned nan, outside [0, 1]" in (rollout.error or "")
    scored = Rollout("test/body", 0, 0, [1], [2], [-0.1], [0], "stop", reward=0.8)
    metrics = domain_metrics([rollout, scored])
    assert metrics["reward"] == pytest.approx(0.8)  # the NaN one is not a 0 in the mean
    assert metrics["rollout/infra_failed/invalid_reward"] == 1


def test_a_none_reward_is_an_invalid_reward() -> None:
    rollout, _ = _score(lambda _inp, _n: None, RetryPolicy(infra_retries=0))
    assert rollout.infra_failure == "invalid_reward" and rollout.retries == 0


def test_a_scorer_that_fails_once_is_retried_and_then_scored() -> None:
    def flaky(_inp: RewardInput, call: int) -> float:
        if call == 1:
            raise RuntimeError("grader hiccup")
        return 0.5

    rollout, calls = _score(flaky)
    assert calls == 2 and rollout.infra_failure is None and rollout.error is None
    assert rollout.reward == 0.5 and rollout.components == {"value": 0.5}
    assert rollout.retry_reasons == ["scorer_error"] and rollout.retries == 1


def test_a_scoring_past_its_deadline_is_a_scorer_timeout() -> None:
    async def hangs(_inp: RewardInput, _call: int) -> float:
        await asyncio.sleep(30)
        return 1.0

    rollout, calls = _score(hangs, RetryPolicy(infra_retries=1, score_timeout_s=0.05))
    assert rollout.infra_failure == "scorer_timeout" and calls == 2
    assert "rollout.score_timeout_s = 0.05 s" in (rollout.error or "")


def test_an_infra_error_keeps_its_own_reason() -> None:
    def judge_down(_inp: RewardInput, _call: int) -> float:
        raise InfraError(InfraReason.JUDGE_ERROR, "the judge answered 503")

    rollout, _ = _score(judge_down)
    assert rollout.infra_failure == "judge_error" and rollout.error == "InfraError: the judge answered 503"


async def test_a_score_whose_total_is_not_a_reward_is_invalid() -> None:
    async def attempt() -> Score:
        return Score(total=math.inf, components={}, weights={}, passed=False)

    attempts = await retry_scoring(attempt, RetryPolicy(infra_retries=0))
    assert attempts.failure is InfraReason.INVALID_REWARD and attempts.score is None


def test_the_failure_rate_stops_a_step_above_the_setting_naming_rate_reasons_and_setting() -> None:
    rollouts = [Rollout("a/x", s, 0, [1], [2], [0.0], [0], "stop") for s in range(4)]
    rollouts[0].infra_failure, rollouts[0].error = "sandbox_error", "InfraError: worker died"
    rollouts[1].infra_failure = "sandbox_error"
    rollouts[2].infra_failure = "scorer_timeout"
    check_failure_rate(rollouts, max_rate=0.75)  # 3 of 4 is not above 0.75
    with pytest.raises(InfraFailureRateError) as stopped:
        check_failure_rate(rollouts, max_rate=0.5)
    message = str(stopped.value)
    assert "3 of 4 rollouts (75%)" in message and "sandbox_error 2, scorer_timeout 1" in message
    assert "rollout.max_infra_failure_rate = 0.5" in message and "worker died" in message
