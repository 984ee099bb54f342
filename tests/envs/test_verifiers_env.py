"""verifiers environments (built with verifiers' own classes) as tether environments: tasks from their
datasets, their parsers, their rubrics scored as verifiers scores them, multi-turn and tool episodes."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.envs.verifiers_fixtures import (
    QUESTIONS,
    SYSTEM,
    GuessEnv,
    add,
    install_module,
    multi_turn_env,
    single_turn_env,
    tool_env,
    vf,
)
from tether.envs.context import ScoringContext
from tether.envs.episode import Environment, run_episode, scripted_policy
from tether.envs.errors import EnvError
from tether.envs.registry import EnvRegistry
from tether.envs.verifiers_env import (
    STATE_KEY,
    VerifiersSpec,
    from_verifiers,
    load_verifiers_environment,
    register_verifiers,
)
from tether.errors import InfraError, InfraReason

RIGHT = "<think>\nsimple\n</think>\n<answer>\n5\n</answer>"


async def verifiers_total(vf_env: Any, env: Environment, seed: int, completion: str) -> float:
    """verifiers' own score of the same completion of the same row."""
    task = env.task(seed)
    state = {"turn": 1, "responses": [], "timing": {"total_ms": 0.0}, "answer": task.data["answer"]}
    score = await vf_env.rubric.score_rollout(
        prompt=task.data["prompt"],
        completion=[{"role": "assistant", "content": completion}],
        answer=task.data["answer"],
        state=state,
        info={},
    )
    return float(score.reward)


def test_tasks_are_the_dataset_rows_with_the_envs_own_prompt() -> None:
    env = from_verifiers(single_turn_env(), "vf/add")
    task = env.task(4)  # seed 4 of 3 rows: row 1
    assert task.data["row"] == 1
    assert task.messages == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTIONS[1]["question"]},
    ]
    assert task.reference == "8"
    assert env.task(4) == env.task(4) and not env.multi_turn


@pytest.mark.parametrize(
    "completion",
    [RIGHT, "<answer>\n5\n</answer>", "<answer>6</answer>", "5", "", "x" * 80],
)
async def test_single_turn_score_is_the_verifiers_score_rescaled(completion: str) -> None:
    vf_env = single_turn_env()
    env = from_verifiers(vf_env, "vf/add")
    score = await env.score(env.task(0), completion)
    assert set(score.components) == {"correct_answer", "format_reward_func", "brevity"}
    assert score.weights == {"correct_answer": 1.0, "format_reward_func": 0.2, "brevity": 0.1}
    # weights 1.0, 0.2, -0.1: ours = (verifiers total + 0.1) / 1.3
    expected = await verifiers_total(vf_env, env, 0, completion)
    assert math.isclose(score.total * 1.3 - 0.1, expected, abs_tol=1e-9)
    assert score.passed is (score.components["correct_answer"] == 1.0)


async def test_the_parser_reads_the_answer_and_formats_the_reference() -> None:
    env = from_verifiers(single_turn_env(), "vf/add")
    task = env.task(2)
    assert env.parser.parse(RIGHT).answer == "5"
    assert env.parser.parse("no tags").well_formed is False
    (reference,) = env.reference(task)
    score = await env.score(task, reference["content"])
    assert score.components["correct_answer"] == 1.0 and score.answer == "7"


async def test_multi_turn_env_response_answers_each_reply_until_completed() -> None:
    env = from_verifiers(multi_turn_env(), "vf/guess")
    assert env.max_turns == 4 and env.responder is not None
    replies = [{"role": "assistant", "content": guess} for guess in ("3", "8", "6")]
    result = await run_episode(env, env.task(0), scripted_policy(replies), ScoringContext())
    assert [m["content"] for m in result.messages[2:]] == ["3", "higher", "8", "lower", "6", "correct"]
    assert result.turns == 3
    # solved (1.0, weight 1) and turns 3/4 at weight -0.5: (1.0 - 0.375 + 0.5) / 1.5
    assert result.score.components == {"solved": 1.0, "turns_used": 0.25}
    assert math.isclose(result.score.total, (1.0 - 0.5 * 0.75 + 0.5) / 1.5)


async def test_multi_turn_stops_at_the_envs_max_turns() -> None:
    env = from_verifiers(multi_turn_env(), "vf/guess")
    replies = [{"role": "assistant", "content": "1"}] * 4
    result = await run_episode(env, env.task(0), scripted_policy(replies), ScoringContext())
    assert result.turns == 4 and result.score.components["solved"] == 0.0


async def test_tool_env_runs_its_python_tools_and_scores_the_transcript() -> None:
    vf_env = tool_env()
    env = from_verifiers(vf_env, "vf/add-tool")
    task = env.task(0)
    assert [tool["function"]["name"] for tool in task.tools] == ["add"]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    replies = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "assistant", "content": "The sum is 5."},
    ]
    result = await run_episode(env, task, scripted_policy(replies), ScoringContext())
    assert result.messages[3]["role"] == "tool" and result.messages[3]["content"] == "5"
    assert result.score.components == {"correct_answer": 1.0, "used_tool": 1.0}
    assert result.score.total == 1.0


async def test_tool_env_errors_reach_the_model_as_results() -> None:
    env = from_verifiers(tool_env(), "vf/add-tool")
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": "two"}'}}
    replies = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "assistant", "content": "?"},
    ]
    result = await run_episode(env, env.task(0), scripted_policy(replies), ScoringContext())
    assert "bad arguments for add" in result.messages[3]["content"]
    assert result.score.components == {"correct_answer": 0.0, "used_tool": 1.0}


async def test_the_reward_functions_see_verifiers_state_from_setup_state() -> None:
    class Seeded(GuessEnv):
        async def setup_state(self, state: Any, **kwargs: Any) -> Any:
            state["bonus"] = 1.0
            return state

    def bonus(state: Any) -> float:
        return float(state["bonus"])

    rows = vf_rows([{"question": "Guess.", "answer": "2"}])
    env = from_verifiers(Seeded(dataset=rows, rubric=vf.Rubric(funcs=[bonus]), max_turns=2), "vf/seeded")
    replies = [{"role": "assistant", "content": "2"}]
    result = await run_episode(env, env.task(0), scripted_policy(replies), ScoringContext())
    assert result.score.components == {"bonus": 1.0}


def vf_rows(rows: list[dict[str, str]]) -> Any:
    from datasets import Dataset

    return Dataset.from_list(rows)


class OwnCompletionToolEnv(vf.ToolEnv):
    async def is_completed(self, messages: Any, state: Any, **kwargs: Any) -> bool:
        return True


def one_reward_env(func: Any, weight: float = 1.0) -> Any:
    return vf.SingleTurnEnv(dataset=vf_rows(QUESTIONS), rubric=vf.Rubric(funcs=[func], weights=[weight]))


@pytest.mark.parametrize("value", [1.5, -0.25, float("nan")])
async def test_a_reward_outside_its_range_is_rejected_not_clipped(value: float) -> None:
    def out_of_range(**kwargs: Any) -> float:
        return value

    env = from_verifiers(one_reward_env(out_of_range), "vf/bad")
    with pytest.raises(InfraError, match="outside") as raised:
        await env.score(env.task(0), "5")
    assert raised.value.reason is InfraReason.INVALID_REWARD  # RL leaves the sample out, never scores it 0


async def test_a_declared_reward_range_is_mapped_to_unit() -> None:
    def out_of_ten(**kwargs: Any) -> float:
        return 7.0

    spec = VerifiersSpec(module="", reward_range=(0.0, 10.0))
    env = from_verifiers(one_reward_env(out_of_ten), "vf/ten", spec)
    assert (await env.score(env.task(0), "5")).total == pytest.approx(0.7)


@pytest.mark.parametrize(
    ("returned", "message"),
    [(None, "returned None, expected a number"), ("1", "returned '1', expected a number")],
)
async def test_a_reward_function_that_returns_no_number_is_an_error(returned: Any, message: str) -> None:
    def no_number(**kwargs: Any) -> Any:
        return returned

    env = from_verifiers(one_reward_env(no_number), "vf/none")
    with pytest.raises(EnvError, match=message):
        await env.score(env.task(0), "5")


async def test_a_reward_function_that_raises_is_an_error_not_a_zero() -> None:
    def broken(completion: Any) -> float:
        raise KeyError("missing")

    env = from_verifiers(one_reward_env(broken), "vf/broken")
    with pytest.raises(EnvError, match="'broken' raised KeyError"):
        await env.score(env.task(0), "5")


def test_load_environment_from_a_module_by_name_with_args() -> None:
    def load_environment(num_rows: int = 3) -> Any:
        return vf.SingleTurnEnv(dataset=vf_rows(QUESTIONS[:num_rows]), rubric=vf.Rubric(funcs=[lambda: 1.0]))

    install_module("vf_tether_test_env", load_environment=load_environment)
    registry = EnvRegistry()
    register_verifiers(registry, {"demo": VerifiersSpec("vf-tether-test-env", {"num_rows": 2})})
    env = registry.get("vf/demo")
    assert env.task(2).data["row"] == 0  # 2 rows
    assert registry.info("vf/demo").rewards == ["lambda"]
    assert "verifiers SingleTurnEnv" in registry.info("vf/demo").description


@pytest.mark.parametrize(
    ("module", "args", "message"),
    [
        ("vf_tether_no_such_env", {}, "is not installed"),
        ("vf_tether_no_loader", {}, "has no load_environment"),
        ("vf_tether_wrong_type", {}, "returned int, not a verifiers Environment"),
        ("vf_tether_wrong_type", {"size": 3}, "does not accept args"),
    ],
)
def test_bad_modules_give_clear_errors(module: str, args: dict[str, Any], message: str) -> None:
    install_module("vf_tether_no_loader")
    install_module("vf_tether_wrong_type", load_environment=lambda: 3)
    with pytest.raises(EnvError, match=message):
        load_verifiers_environment(module, args)


def test_an_env_without_dataset_rows_is_refused() -> None:
    env = vf.SingleTurnEnv(dataset=vf_rows(QUESTIONS), rubric=vf.Rubric(funcs=[lambda: 1.0]))
    env.dataset = env.dataset.select([])
    with pytest.raises(EnvError, match="no dataset rows"):
        from_verifiers(env, "vf/empty")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: vf.SingleTurnEnv(dataset=vf_rows(QUESTIONS), rubric=vf.Rubric()), "no reward functions"),
        (
            lambda: vf.SingleTurnEnv(
                dataset=vf_rows(QUESTIONS), rubric=vf.Rubric(funcs=[lambda: 1.0], weights=[0.0])
            ),
            "not all 0",
        ),
        (
            lambda: vf.SingleTurnEnv(
                dataset=vf_rows([{"prompt": "raw text", "answer": "1"}]),
                message_type="completion",
                rubric=vf.Rubric(funcs=[lambda: 1.0]),
            ),
            "only 'chat'",
        ),
        (lambda: 3, "expected a verifiers Environment"),
        (
            lambda: vf.SingleTurnEnv(
                dataset=vf_rows(QUESTIONS), rubric=vf.JudgeRubric(judge_client=object())
            ),
            "use tether's `judge` reward component",
        ),
        (lambda: vf.EnvGroup(envs=[single_turn_env(), tool_env()]), "EnvGroup is not supported"),
        (lambda: OwnCompletionToolEnv(dataset=vf_rows(QUESTIONS), tools=[add]), "overrides is_completed"),
    ],
)
def test_unsupported_environments_are_refused(make: Any, message: str) -> None:
    with pytest.raises(EnvError, match=message):
        from_verifiers(make(), "vf/refused")


async def test_the_episode_keeps_verifiers_state_in_its_info() -> None:
    env = from_verifiers(multi_turn_env(), "vf/guess")
    episode = await env.start(env.task(0), ScoringContext())
    await episode.step({"role": "assistant", "content": "6"})
    assert episode.done and episode.state.info[STATE_KEY]["solved"] is True
