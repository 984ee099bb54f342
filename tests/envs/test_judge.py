"""The judge reward component: its request, strict verdicts, the cache, usage and cost, and its failures."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal

import pytest

from tether.chat import ChatRequest, Completion, FinishReason, Usage, assistant_message
from tether.chat.completion import ModelError
from tether.chat.pricing import Price, cost_usd
from tether.envs.context import ScoringContext
from tether.envs.episode import Environment
from tether.envs.judge import JudgeConfig, JudgeReward, parse_verdict
from tether.envs.parsers import ANSWER_TAG
from tether.envs.scoring import Reward, Rubric
from tether.envs.tasks import ChatRenderer, Problem, Task
from tether.errors import ConfigError, InfraError, InfraReason

USAGE = Usage(prompt_tokens=120, cached_tokens=40, completion_tokens=16)


class VerdictClient:
    """A judge that answers every request with `content`, counting what it was asked."""

    name = "verdicts"

    def __init__(
        self,
        content: str = '{"reason": "right", "score": 0.75}',
        finish: FinishReason = FinishReason.STOP,
        error: Exception | None = None,
    ) -> None:
        self.content, self.finish, self.error = content, finish, error
        self.requests: list[ChatRequest] = []
        self.in_flight = self.most_in_flight = 0
        self.closed = 0

    async def complete(self, request: ChatRequest) -> Completion:
        self.requests.append(request)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.01)  # long enough for concurrent requests to overlap
        self.in_flight -= 1
        if self.error is not None:
            raise self.error
        return Completion(assistant_message(self.content), USAGE, self.finish)

    async def close(self) -> None:
        self.closed += 1


class _Source:
    def problem(self, seed: int) -> Problem:
        return Problem(prompt=f"What is {seed} + 1?", answer=str(seed + 1))


def judged_env(judge: JudgeReward) -> Environment:
    return Environment(
        name="test/judged",
        source=_Source(),
        renderer=ChatRenderer("Answer in <answer> tags."),
        parser=ANSWER_TAG,
        rubric=Rubric((Reward("judge", judge),)),
    )


def judge_of(client: VerdictClient, **settings: object) -> JudgeReward:
    return JudgeReward(JudgeConfig(model="judge-model", **settings), lambda: client)  # type: ignore[arg-type]


async def score(env: Environment, task: Task, completion: str, ctx: ScoringContext) -> float:
    return (await env.score(task, completion, ctx.child())).components["judge"]


def test_a_verdict_is_the_component_and_its_usage_and_cost_are_counted() -> None:
    client = VerdictClient()
    price = Price(input_cache_hit_per_mtok=Decimal("0.5"), output_per_mtok=Decimal("2"))
    env = judged_env(judge_of(client, price=price))
    task = env.task(41)
    ctx = ScoringContext()
    assert asyncio.run(score(env, task, "<answer>42</answer>", ctx)) == 0.75
    (request,) = client.requests
    (message,) = request.messages
    assert "What is 41 + 1?" in message["content"] and "\n42\n" in message["content"]  # prompt, reference
    assert "<answer>42</answer>" in message["content"]
    assert request.temperature == 0.0
    assert request.response_format is not None and request.response_format["type"] == "json_schema"
    assert request.response_format["json_schema"]["schema"]["required"] == ["reason", "score"]
    assert ctx.take_counters() == {
        "judge/requests": 1.0,
        "judge/cache_hits": 0.0,
        "judge/prompt_tokens": 120.0,
        "judge/cached_tokens": 40.0,
        "judge/completion_tokens": 16.0,
        "judge/cost_usd": float(cost_usd(USAGE, price)),
    }
    assert ctx.take_counters() == {}  # taken: the next step starts from zero


def test_the_same_answer_is_judged_once_whether_asked_together_or_later() -> None:
    client = VerdictClient()
    env = judged_env(judge_of(client))
    task = env.task(1)
    ctx = ScoringContext()

    async def run() -> list[float]:
        together = await asyncio.gather(*(score(env, task, "<answer>2</answer>", ctx) for _ in range(4)))
        later = await score(env, task, "<answer>2</answer>", ctx)
        other = await score(env, task, "<answer>3</answer>", ctx)  # another answer: another request
        return [*together, later, other]

    assert asyncio.run(run()) == [0.75] * 6
    assert len(client.requests) == 2
    counters = ctx.take_counters()
    assert counters["judge/requests"] == 2 and counters["judge/cache_hits"] == 4
    assert counters["judge/prompt_tokens"] == 2 * USAGE.prompt_tokens


def test_requests_in_flight_stay_within_the_concurrency_limit() -> None:
    client = VerdictClient()
    env = judged_env(judge_of(client, concurrency=3))
    task = env.task(1)

    async def run() -> None:
        ctx = ScoringContext()
        await asyncio.gather(*(score(env, task, f"<answer>{i}</answer>", ctx) for i in range(10)))

    asyncio.run(run())
    assert len(client.requests) == 10 and client.most_in_flight == 3


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("the answer is right", "is not JSON"),
        ('{"score": 1}', "exactly 'reason' and 'score'"),
        ('{"reason": "ok", "score": 1, "confidence": 0.9}', "exactly 'reason' and 'score'"),
        ('[{"reason": "ok", "score": 1}]', "exactly 'reason' and 'score'"),
        ('{"reason": "ok", "score": 1.5}', "expected a number in"),
        ('{"reason": "ok", "score": -0.1}', "expected a number in"),
        ('{"reason": "ok", "score": true}', "expected a number in"),
        ('{"reason": "ok", "score": "1"}', "expected a number in"),
        ('{"reason": "ok", "score": NaN}', "expected a number in"),
        ('{"reason": 3, "score": 1}', "'reason' string"),
        (json.dumps({"reason": "x" * 1001, "score": 1}), "'reason' string of at most 1000 characters"),
    ],
)
def test_a_malformed_verdict_is_a_judge_error_not_a_reward(content: str, why: str) -> None:
    client = VerdictClient(content)
    env = judged_env(judge_of(client))
    task = env.task(1)
    with pytest.raises(InfraError, match=why) as raised:
        asyncio.run(score(env, task, "<answer>2</answer>", ScoringContext()))
    assert raised.value.reason is InfraReason.JUDGE_ERROR
    # A failed verdict is not cached: the next scoring asks again.
    client.content = '{"reason": "ok", "score": 1}'
    assert asyncio.run(score(env, task, "<answer>2</answer>", ScoringContext())) == 1.0
    assert len(client.requests) == 2


@pytest.mark.parametrize(
    ("client", "why"),
    [
        (VerdictClient(error=ModelError("no server answers at http://judge:1/v1")), "no server answers"),
        (VerdictClient(finish=FinishReason.LENGTH, content='{"reason": "it is'), "cut off at max_tokens"),
    ],
)
def test_a_failed_request_is_a_judge_error(client: VerdictClient, why: str) -> None:
    env = judged_env(judge_of(client))
    with pytest.raises(InfraError, match=why) as raised:
        asyncio.run(score(env, env.task(1), "<answer>2</answer>", ScoringContext()))
    assert raised.value.reason is InfraReason.JUDGE_ERROR


def test_labels_are_the_verdicts_vocabulary_and_map_to_their_scores() -> None:
    config = JudgeConfig(model="m", labels={"correct": 1.0, "partial": 0.5, "wrong": 0.0})
    assert config.schema()["properties"]["score"] == {
        "type": "string",
        "enum": ["correct", "partial", "wrong"],
    }
    assert parse_verdict('{"reason": "half", "score": "partial"}', config).score == 0.5
    with pytest.raises(InfraError, match="expected one of 'correct', 'partial', 'wrong'"):
        parse_verdict('{"reason": "?", "score": 0.5}', config)


def test_a_custom_rubric_fills_in_its_fields_and_literal_braces() -> None:
    client = VerdictClient()
    env = judged_env(judge_of(client, rubric='Grade {answer} against {reference}; reply {{"score": ...}}'))
    asyncio.run(score(env, env.task(4), "<answer>5</answer>", ScoringContext()))
    assert (
        client.requests[0].messages[0]["content"]
        == 'Grade <answer>5</answer> against 5; reply {"score": ...}'
    )


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"rubric": "Grade {answer} for {question}"}, r"unknown field\(s\) \{question\}"),
        ({"rubric": "Grade the reply to {prompt}"}, "must contain {answer}"),
        ({"rubric": "Grade {answer} as {json"}, "literal brace"),
        ({"labels": {}}, "at least one label"),
        ({"labels": {"good": 2.0}}, r"must be in \[0, 1\]"),
        ({"concurrency": 0}, "concurrency = 0"),
    ],
)
def test_bad_judge_settings_are_refused(settings: dict[str, object], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        JudgeConfig(model="m", **settings)  # type: ignore[arg-type]


async def test_the_judges_client_is_closed_with_the_scoring_context_it_was_opened_in() -> None:
    client = VerdictClient()
    env, ctx = judged_env(judge_of(client)), ScoringContext()
    task = env.task(1)
    await score(env, task, "<answer>2</answer>", ctx)
    await score(env, task, "<answer>3</answer>", ctx)  # the same client: registered once
    await ctx.aclose()
    assert client.closed == 1
    await ctx.aclose()  # nothing left to close
    assert client.closed == 1
