"""The environment core: rubric arithmetic, task serialisation, and the episode protocol (no sandbox)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from tether.chat import JsonDict, ToolCall, ToolSpec
from tether.chat.tool_format import HERMES
from tether.envs.context import ScoringContext
from tether.envs.episode import Environment, run_episode, scripted_policy
from tether.envs.errors import EnvError
from tether.envs.parsers import ANSWER_TAG
from tether.envs.rubric import answer_rubric, length_within
from tether.envs.scoring import EpisodeState, Reward, RewardInput, Rubric
from tether.envs.tasks import ChatRenderer, Parsed, Problem, Task, check_name, check_seed
from tether.errors import InfraError, InfraReason
from tether.tools import SUBMIT, Tool, Workspace


class CountingSource:
    """Problem `seed`: the answer is seed * 2."""

    def problem(self, seed: int) -> Problem:
        return Problem(prompt=f"double {seed}", answer=str(seed * 2), data={"seed": seed})


def exact(inp: RewardInput) -> float:
    return 1.0 if inp.parsed.answer == inp.task.reference else 0.0


def single_turn(**overrides: Any) -> Environment:
    fields: dict[str, Any] = {
        "name": "test/double",
        "source": CountingSource(),
        "renderer": ChatRenderer("system prompt"),
        "parser": ANSWER_TAG,
        "rubric": answer_rubric(exact),
    }
    return Environment(**{**fields, **overrides})


async def echo(_workspace: Workspace, arguments: JsonDict, _key: str) -> str:
    return str(arguments["text"])


ECHO = Tool(
    ToolSpec(
        "echo",
        "Echo text.",
        {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    ),
    echo,
)


def multi_turn(**overrides: Any) -> Environment:
    return single_turn(name="test/tools", tools=(ECHO, SUBMIT), max_turns=4, **overrides)


def call(name: str, arguments: Any, call_id: str = "c0") -> dict[str, Any]:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"role": "assistant", "content": "", "tool_calls": [ToolCall(call_id, name, raw).openai()]}


def reward_input(answer: str | None = "4") -> RewardInput:
    task = single_turn().task(2)
    return RewardInput(task, answer or "", Parsed(answer, True), ScoringContext())


async def test_gate_zeroes_the_total_when_the_answer_is_wrong() -> None:
    rubric = Rubric((Reward("correct", lambda _: 0.0, 0.5, gate=True), Reward("format", lambda _: 1.0, 0.5)))
    score = await rubric.score(reward_input())
    assert score.total == 0.0
    assert score.components == {"correct": 0.0, "format": 1.0}
    assert not score.passed


async def test_total_is_the_weighted_mean_times_the_gates() -> None:
    rubric = Rubric(
        (
            Reward("correct", lambda _: 0.5, 3.0, gate=True),
            Reward("format", lambda _: 1.0, 1.0),
            Reward("recorded", lambda _: 0.25, 0.0),
        )
    )
    score = await rubric.score(reward_input())
    assert score.total == pytest.approx(0.5 * (0.5 * 3 + 1.0) / 4)
    assert score.components["recorded"] == 0.25
    assert score.weights == {"correct": 3.0, "format": 1.0, "recorded": 0.0}


async def test_async_reward_functions_are_awaited() -> None:
    async def later(inp: RewardInput) -> float:
        return 1.0

    score = await Rubric((Reward("later", later),)).score(reward_input())
    assert score.total == 1.0 and score.passed


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan, None, "1.0"])
async def test_a_reward_outside_zero_one_is_an_invalid_reward(value: object) -> None:
    with pytest.raises(InfraError, match="outside") as caught:
        await Rubric((Reward("bad", lambda _: value),)).score(reward_input())  # type: ignore[arg-type,return-value]
    assert caught.value.reason is InfraReason.INVALID_REWARD


@pytest.mark.parametrize(
    ("rewards", "message"),
    [
        ((), "at least one"),
        ((Reward("a", exact), Reward("a", exact)), "unique"),
        ((Reward("a", exact, 0.0),), "sum to 0"),
    ],
)
def test_invalid_rubrics_are_refused(rewards: tuple[Reward, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Rubric(rewards)


@pytest.mark.parametrize(("name", "weight"), [("Bad Name", 1.0), ("ok", -1.0), ("ok", math.inf)])
def test_invalid_rewards_are_refused(name: str, weight: float) -> None:
    with pytest.raises(ValueError):
        Reward(name, exact, weight)


def test_pass_component_must_exist() -> None:
    with pytest.raises(ValueError, match="pass_component"):
        Rubric((Reward("a", exact),), pass_component="b")


def test_length_reward_falls_linearly_past_the_budget() -> None:
    length = length_within(10)
    task = single_turn().task(1)

    def of(text: str) -> float:
        return length(RewardInput(task, text, Parsed(None, False), ScoringContext()))

    assert of("x" * 10) == 1.0
    assert of("x" * 15) == pytest.approx(0.5)
    assert of("x" * 30) == 0.0
    with pytest.raises(ValueError):
        length_within(0)


def test_same_seed_gives_the_same_task_and_it_round_trips_through_json() -> None:
    env = single_turn()
    task = env.task(7)
    assert task == env.task(7)
    assert task != env.task(8)
    assert task.messages[0] == {"role": "system", "content": "system prompt"}
    assert Task.from_dict(json.loads(json.dumps(task.to_dict()))) == task


def test_the_system_prompt_is_the_same_for_every_task() -> None:
    env = single_turn()
    assert len({json.dumps(env.task(seed).messages[0]) for seed in range(20)}) == 1


@pytest.mark.parametrize(
    "raw",
    [
        {},
        {"env": "a/b", "seed": 1, "messages": []},
        {"env": "ab", "seed": 1, "messages": [], "reference": ""},
        {"env": "a/b", "seed": 1, "messages": "hi", "reference": ""},
        {"env": "a/b", "seed": 1, "messages": [], "reference": 3},
        {"env": "a/b", "seed": 1, "messages": [], "reference": "", "max_turns": "many"},
        {"env": "a/b", "seed": 1, "messages": [], "reference": "", "data": []},
    ],
)
def test_malformed_tasks_are_refused(raw: dict[str, Any]) -> None:
    with pytest.raises(EnvError):
        Task.from_dict(raw)


@pytest.mark.parametrize("name", ["noslash", "Upper/x", "a/b/c", "/x", "a/", "a b/c", "a/-x"])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(EnvError, match="family/name"):
        check_name(name)


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True, "3"])
def test_bad_seeds_are_refused(seed: Any) -> None:
    with pytest.raises(EnvError, match="seed"):
        check_seed(seed)


def test_problem_data_must_be_json() -> None:
    class BadSource:
        def problem(self, seed: int) -> Problem:
            return Problem("q", "a", {"when": object()})

    with pytest.raises(TypeError, match="JSON-serialisable"):
        single_turn(source=BadSource()).task(0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_turns": 0}, "max_turns"),
        ({"tools": (ECHO,)}, "max_turns > 1"),
        ({"tools": (ECHO, ECHO), "max_turns": 3}, "unique"),
    ],
)
def test_invalid_environments_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        single_turn(**overrides)


async def test_single_turn_reference_scores_one_and_wrong_answers_zero() -> None:
    env = single_turn()
    task = env.task(21)
    reference = await env.score(task, env.reference(task)[0]["content"])
    assert reference.total == 1.0 and reference.passed and reference.answer == "42"
    for wrong in env.wrong_answers(task):
        assert (await env.score(task, wrong)).total == 0.0, wrong


async def test_a_task_of_another_environment_is_refused() -> None:
    task = single_turn().task(1)
    with pytest.raises(EnvError, match="given to environment"):
        await multi_turn().start(task, ScoringContext())


async def test_tools_run_and_submit_ends_the_episode() -> None:
    env = multi_turn()
    task = env.task(3)
    assert [tool["function"]["name"] for tool in task.tools] == ["echo", "submit"]
    replies = [call("echo", {"text": "hi"}), call("submit", {"answer": "6"})]
    result = await run_episode(env, task, scripted_policy(replies), ScoringContext())
    assert result.turns == 2
    assert result.messages[3] == {"role": "tool", "tool_call_id": "c0", "name": "echo", "content": "hi"}
    assert result.score.total == 1.0 and result.score.answer == "6"


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (call("nope", {}), "unknown tool 'nope'"),
        (HERMES.parse("<tool_call>nope</tool_call>").message(), "your tool call could not be read"),
        (call("echo", "{not json"), "not valid JSON"),
        (call("echo", "[1, 2]"), "must be a JSON object"),
        (call("echo", {}), "arguments: 'text' is a required property"),
        (call("echo", {"text": 5}), "text: 5 is not of type 'string'"),
    ],
)
async def test_bad_tool_calls_are_answered_with_an_error_not_raised(
    reply: dict[str, Any], error: str
) -> None:
    env = multi_turn()
    episode = await env.start(env.task(1), ScoringContext())
    results = await episode.step(reply)
    assert error in results[0]["content"]
    assert not episode.done


async def test_a_reply_without_tool_calls_is_the_final_answer() -> None:
    env = multi_turn()
    task = env.task(5)
    result = await run_episode(
        env,
        task,
        scripted_policy([{"role": "assistant", "content": "<answer>10</answer>"}]),
        ScoringContext(),
    )
    assert result.turns == 1 and result.score.total == 1.0


async def test_the_episode_ends_at_max_turns() -> None:
    env = multi_turn()
    result = await run_episode(
        env, env.task(1), scripted_policy([call("echo", {"text": "x"})] * 4), ScoringContext()
    )
    assert result.turns == 4 and result.score.total == 0.0


async def test_a_validator_violation_ends_the_episode_with_zero_and_a_reason() -> None:
    seen: list[int] = []

    async def protected(state: EpisodeState) -> str | None:
        seen.append(state.turns)
        return "tests.py changed" if state.turns == 2 else None

    env = multi_turn(validators=(protected,))
    replies = [call("echo", {"text": "a"}), call("echo", {"text": "b"}), call("submit", {"answer": "2"})]
    episode = await env.start(env.task(1), ScoringContext())
    await episode.step(replies[0])
    await episode.step(replies[1])
    assert episode.done and seen == [1, 2]
    score = await episode.score()
    assert score.total == 0.0 and score.qc_violation == "tests.py changed"
    assert set(score.components) == {"correctness", "format", "length"}
    with pytest.raises(EnvError, match="already done"):
        await episode.step(replies[2])


async def test_validators_run_after_the_final_step_too() -> None:
    async def always(state: EpisodeState) -> str | None:
        return "grader modified"

    env = single_turn(validators=(always,))
    task = env.task(1)
    score = await env.score(task, env.reference(task)[0]["content"])
    assert score.total == 0.0 and score.qc_violation == "grader modified"


async def test_long_tool_output_is_truncated() -> None:
    env = multi_turn(max_tool_output_chars=10)
    episode = await env.start(env.task(1), ScoringContext())
    results = await episode.step(call("echo", {"text": "y" * 50}))
    assert results[0]["content"].startswith("y" * 10)
    assert "truncated to 10 characters" in results[0]["content"]


@pytest.mark.parametrize(
    "reply",
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": 5},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]},
    ],
)
async def test_malformed_replies_are_refused(reply: dict[str, Any]) -> None:
    env = multi_turn()
    episode = await env.start(env.task(1), ScoringContext())
    with pytest.raises(EnvError):
        await episode.step(reply)


async def test_a_scripted_policy_that_runs_out_is_an_error() -> None:
    env = multi_turn()
    with pytest.raises(EnvError, match="ran out"):
        await run_episode(env, env.task(1), scripted_policy([call("echo", {"text": "x"})]), ScoringContext())


async def test_an_environment_needing_a_sandbox_fails_clearly_without_one() -> None:
    async def setup(state: EpisodeState) -> None:
        return None

    env = multi_turn(setup=setup)
    with pytest.raises(EnvError, match="no sandbox"):
        await env.start(env.task(1), ScoringContext())


async def test_reward_functions_can_explain_their_score_in_detail() -> None:
    def explained(inp: RewardInput) -> float:
        inp.detail["why"] = "off by one"
        return 0.0

    score = await Rubric((Reward("correct", explained),)).score(reward_input())
    assert score.detail == {"why": "off by one"}
    assert score.to_dict()["detail"] == {"why": "off by one"}


@pytest.mark.parametrize("overrides", [{"max_turns": 1}, {"tools": (ECHO,), "max_turns": 3}])
def test_a_responder_needs_several_turns_and_no_tools(overrides: dict[str, Any]) -> None:
    async def respond(state: EpisodeState) -> tuple[list[JsonDict], bool]:
        return [{"role": "user", "content": "again"}], False

    with pytest.raises(ValueError, match="a responder needs max_turns > 1 and no tools"):
        single_turn(responder=respond, **overrides)


async def test_a_responders_messages_answer_each_reply_until_it_says_done() -> None:
    async def respond(state: EpisodeState) -> tuple[list[JsonDict], bool]:
        return [{"role": "user", "content": f"turn {state.turns}"}], state.turns == 2

    env = single_turn(responder=respond, max_turns=5)
    replies = [{"role": "assistant", "content": "<answer>0</answer>"}] * 2
    result = await run_episode(env, env.task(0), scripted_policy(replies), ScoringContext())
    answer = replies[0]["content"]
    assert [m["content"] for m in result.messages[2:]] == [answer, "turn 1", answer, "turn 2"]
    assert result.turns == 2 and result.score.passed
