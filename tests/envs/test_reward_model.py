"""The reward-model component: conversations scored in batches, and a scorer's failures as judge errors."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from tether.chat import Messages
from tether.envs.context import ScoringContext
from tether.envs.episode import Environment
from tether.envs.parsers import ANSWER_TAG
from tether.envs.reward_model import RewardModelReward
from tether.envs.scoring import Reward, Rubric
from tether.envs.tasks import ChatRenderer, Problem
from tether.errors import ConfigError, InfraError, InfraReason


class LengthScorer:
    """Scores a conversation by its answer's length (capped at 1), recording each batch it is given."""

    name = "length"

    def __init__(self, result: list[float] | None = None, error: Exception | None = None) -> None:
        self.batches: list[list[Messages]] = []
        self.result, self.error = result, error

    def score(self, conversations: Sequence[Messages]) -> list[float]:
        self.batches.append(list(conversations))
        if self.error is not None:
            raise self.error
        if self.result is not None:
            return self.result
        return [min(1.0, len(str(c[-1]["content"])) / 20) for c in conversations]


class _Source:
    def problem(self, seed: int) -> Problem:
        return Problem(prompt=f"Say {seed}.", answer=str(seed))


def scored_env(reward: RewardModelReward) -> Environment:
    return Environment(
        name="test/rm",
        source=_Source(),
        renderer=ChatRenderer("Answer in <answer> tags."),
        parser=ANSWER_TAG,
        rubric=Rubric((Reward("reward_model", reward),)),
    )


async def score_all(env: Environment, completions: list[str]) -> list[float]:
    task = env.task(3)
    ctx = ScoringContext()
    scores = await asyncio.gather(*(env.score(task, c, ctx.child()) for c in completions))
    return [s.components["reward_model"] for s in scores]


def test_answers_scored_together_go_to_the_model_in_batches_of_at_most_max_batch() -> None:
    scorer = LengthScorer()
    env = scored_env(RewardModelReward(scorer, max_batch=4))
    completions = ["x" * n for n in range(10)]
    assert asyncio.run(score_all(env, completions)) == [n / 20 for n in range(10)]
    assert [len(batch) for batch in scorer.batches] == [4, 4, 2]
    first = scorer.batches[0][0]  # the whole conversation: system, user, then the answer
    assert [m["role"] for m in first] == ["system", "user", "assistant"] and first[1]["content"] == "Say 3."


@pytest.mark.parametrize(
    ("scorer", "why"),
    [
        (LengthScorer(error=RuntimeError("CUDA out of memory")), "RuntimeError: CUDA out of memory"),
        (LengthScorer(result=[0.5, 1.5]), r"outside \[0, 1\]"),
        (LengthScorer(result=[0.5, float("nan")]), r"outside \[0, 1\]"),
        (LengthScorer(result=[0.5]), "1 scores for 2 conversations"),
    ],
)
def test_a_failing_or_out_of_range_reward_model_is_a_judge_error(scorer: LengthScorer, why: str) -> None:
    env = scored_env(RewardModelReward(scorer))
    with pytest.raises(InfraError, match=why) as raised:
        asyncio.run(score_all(env, ["a", "b"]))
    assert raised.value.reason is InfraReason.JUDGE_ERROR


def test_max_batch_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max_batch = 0"):
        RewardModelReward(LengthScorer(), max_batch=0)
