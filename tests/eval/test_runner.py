"""Evaluation through the one model seam: episodes ask a `ChatClient` (scripted, an OpenAI-compatible
server, the in-process engine), with the task's tools, concurrency bounded by the settings, and token
counts taken from each completion's usage."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tether.chat import ChatRequest, Completion, ToolCall, ToolSpec, Usage, assistant_message
from tether.chat.openai_client import OpenAIClient
from tether.chat.tool_format import HERMES, MALFORMED_TOOL
from tether.envs import math as math_envs
from tether.envs import structured
from tether.envs.context import ScoringContext
from tether.envs.episode import Environment
from tether.envs.errors import EnvError
from tether.envs.parsers import ANSWER_TAG
from tether.envs.registry import EnvRegistry, Mixture
from tether.envs.rubric import hedged
from tether.envs.scoring import Reward, RewardInput, Rubric
from tether.envs.tasks import ChatRenderer, Problem
from tether.errors import ConfigError
from tether.eval.runner import EpisodeRecord, EvalSettings, plan_episodes, run_eval
from tether.testing.scripted import ScriptedClient
from tether.tools import Tool, Workspace


def registry() -> EnvRegistry:
    registry = EnvRegistry()
    math_envs.register(registry)
    structured.register(registry)
    return registry


class Oracle:
    """Answers every task with its reference (looked up by the user prompt), or with a wrong answer;
    counts the requests in flight at once."""

    name = "oracle"

    def __init__(
        self, registry: EnvRegistry, plan: list[tuple[str, int]], wrong: frozenset[str] = frozenset()
    ) -> None:
        self.answers: dict[str, str] = {}
        for name, seed in plan:
            task = registry.get(name).task(seed)
            answer = "<answer>nope</answer>" if name in wrong else ANSWER_TAG.format(task.reference)
            self.answers[task.messages[1]["content"]] = answer
        self.requests: list[ChatRequest] = []
        self.in_flight = self.most_in_flight = 0

    async def complete(self, request: ChatRequest) -> Completion:
        self.requests.append(request)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.01)  # the other episodes reach their requests meanwhile
        self.in_flight -= 1
        answer = self.answers[request.messages[1]["content"]]
        return Completion(assistant_message(answer), Usage(prompt_tokens=10, completion_tokens=5))

    async def close(self) -> None:
        return None


def test_plans_give_n_per_environment_or_n_in_all() -> None:
    mixture = Mixture((("a/x", 1.0), ("b/y", 3.0)))
    assert plan_episodes(mixture, 2, 10, per_env=True) == [("a/x", 10), ("a/x", 11), ("b/y", 10), ("b/y", 11)]
    assert [name for name, _ in plan_episodes(mixture, 4, 0, per_env=False)] == ["a/x", "b/y", "b/y", "b/y"]
    with pytest.raises(EnvError, match="at least 1"):
        plan_episodes(mixture, 0, 0, per_env=True)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_tokens": 0}, "max_tokens = 0: expected an integer >= 1"),
        ({"temperature": -0.5}, "temperature = -0.5: expected a number >= 0"),
        ({"concurrency": 0}, "concurrency = 0: expected an integer >= 1"),
    ],
)
def test_bad_settings_are_refused_naming_the_value(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EvalSettings(**options)


async def test_an_oracle_scores_one_everywhere_with_tokens_from_usage() -> None:
    reg = registry()
    plan = plan_episodes(Mixture((("math/fractions", 1.0), ("structured/person", 1.0))), 5, 0, per_env=True)
    oracle = Oracle(reg, plan)
    done: list[EpisodeRecord] = []
    settings = EvalSettings(max_tokens=32, temperature=0.7, seed=4, concurrency=8)
    records = await run_eval(reg, plan, oracle, ScoringContext(), settings, on_done=done.append)
    assert [r.reward for r in records] == [1.0] * 10 and len(done) == 10
    assert all((r.prompt_tokens, r.completion_tokens, r.turns) == (10, 5, 1) for r in records)
    assert oracle.most_in_flight > 1  # episodes run concurrently
    request = oracle.requests[0]
    assert (request.max_tokens, request.temperature, request.seed, request.step_no) == (32, 0.7, 4, 0)
    assert request.tools == ()
    record = records[0].to_dict()
    assert (
        record["transcript"][-1]["role"] == "assistant"
        and record["score"]["components"]["correctness"] == 1.0
    )
    json.dumps(record)


async def test_greedy_requests_carry_no_seed() -> None:
    reg = registry()
    oracle = Oracle(reg, [("math/fractions", 0)])
    await run_eval(reg, [("math/fractions", 0)], oracle, ScoringContext(), EvalSettings(seed=4))
    assert oracle.requests[0].seed is None


async def test_concurrency_is_bounded_by_the_setting() -> None:
    reg = registry()
    plan = [("math/fractions", seed) for seed in range(6)]
    oracle = Oracle(reg, plan)
    records = await run_eval(reg, plan, oracle, ScoringContext(), EvalSettings(concurrency=2))
    assert oracle.most_in_flight == 2 and len(records) == 6


async def test_a_wrong_answer_scores_zero_and_a_hedge_too() -> None:
    reg = registry()
    plan = [("math/fractions", 0), ("math/powers", 3)]
    oracle = Oracle(reg, plan, wrong=frozenset({"math/fractions"}))
    task = reg.get("math/powers").task(3)
    oracle.answers[task.messages[1]["content"]] = hedged(ANSWER_TAG, task.reference)
    records = await run_eval(reg, plan, oracle, ScoringContext())
    assert [r.reward for r in records] == [0.0, 0.0] and all(r.error is None for r in records)


async def test_a_client_failure_is_recorded_per_episode_not_raised() -> None:
    class Broken:
        name = "broken"

        async def complete(self, request: ChatRequest) -> Completion:
            raise RuntimeError("server down")

        async def close(self) -> None:
            return None

    records = await run_eval(
        registry(), [("math/fractions", 0), ("math/powers", 1)], Broken(), ScoringContext()
    )
    assert all(r.error == "RuntimeError: server down" and r.reward == 0.0 for r in records)


async def test_unknown_environments_fail_before_any_request() -> None:
    oracle = Oracle(registry(), [])
    with pytest.raises(EnvError, match="unknown environment"):
        await run_eval(registry(), [("math/nope", 0)], oracle, ScoringContext())
    assert oracle.requests == []


# A multi-turn environment whose tools run in this process: `lookup` reads the task's data, `answer` ends
# the episode with the submitted answer.
LOOKUP = ToolSpec("lookup", "Look the secret up.", {"type": "object", "properties": {}})
ANSWER = ToolSpec(
    "answer",
    "Give the final answer; this ends the episode.",
    {"type": "object", "properties": {"value": {"type": "string"}}, "required": ["value"]},
)


@dataclass(frozen=True, slots=True)
class _Secrets:
    def problem(self, seed: int) -> Problem:
        return Problem(
            prompt="What is the secret? Look it up.", answer=f"s{seed}", data={"secret": f"s{seed}"}
        )


LOOKED_UP = "s3"  # what `lookup` reads, whatever the seed: the secret of seed 3


async def _lookup(_workspace: Workspace, arguments: dict[str, Any], _key: str) -> str:
    return LOOKED_UP


async def _answer(_workspace: Workspace, arguments: dict[str, Any], _key: str) -> str:
    return str(arguments["value"])  # an ending tool's result is the episode's final answer


def _correct(inp: RewardInput) -> float:
    return float(inp.completion == inp.task.reference)


def secrets_registry() -> EnvRegistry:
    reg = EnvRegistry()
    reg.add(
        Environment(
            name="test/secrets",
            source=_Secrets(),
            renderer=ChatRenderer("Use the tools."),
            parser=ANSWER_TAG,
            rubric=Rubric((Reward("correctness", _correct),)),
            tools=(Tool(LOOKUP, _lookup), Tool(ANSWER, _answer, ends=True)),
            max_turns=4,
        )
    )
    return reg


def _server(seen: list[dict[str, Any]]) -> httpx.MockTransport:
    """An OpenAI-compatible server whose model looks the secret up, then answers with what it read."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append({"body": body, "auth": request.headers.get("authorization"), "path": request.url.path})
        results = [m for m in body["messages"] if m["role"] == "tool"]
        name, arguments = ("answer", {"value": results[-1]["content"]}) if results else ("lookup", {})
        call = ToolCall(f"x{len(results)}", name, json.dumps(arguments))
        message = {"role": "assistant", "content": None, "tool_calls": [call.openai()]}
        usage = {"prompt_tokens": 12, "completion_tokens": 3}
        choice = {"message": message, "finish_reason": "tool_calls"}
        return httpx.Response(200, json={"choices": [choice], "usage": usage})

    return httpx.MockTransport(handle)


async def test_an_openai_server_runs_a_tool_using_episode() -> None:
    seen: list[dict[str, Any]] = []
    client = OpenAIClient("http://server/v1/", "m", api_key="k", transport=_server(seen))
    try:
        [record] = await run_eval(
            secrets_registry(), [("test/secrets", 3)], client, ScoringContext(), EvalSettings(max_tokens=64)
        )
    finally:
        await client.close()
    assert record.error is None and record.reward == 1.0 and record.turns == 2
    assert (record.prompt_tokens, record.completion_tokens) == (24, 6)
    assert seen[0]["path"] == "/v1/chat/completions" and seen[0]["auth"] == "Bearer k"
    assert seen[0]["body"]["tools"] == [LOOKUP.openai(), ANSWER.openai()]
    assert seen[0]["body"]["max_tokens"] == 64
    assert seen[1]["body"]["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "x0",
        "name": "lookup",
        "content": "s3",
    }


async def test_a_scripted_client_plays_one_reply_per_step(tmp_path: Path) -> None:
    script = tmp_path / "replies.jsonl"
    lines = [
        {"tool_calls": [{"name": "lookup"}]},
        {"tool_calls": [{"name": "answer", "arguments": {"value": "s5"}}]},
    ]
    script.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    plan = [("test/secrets", 5), ("test/secrets", 6)]
    records = await run_eval(secrets_registry(), plan, ScriptedClient.from_file(script), ScoringContext())
    assert [r.reward for r in records] == [1.0, 0.0]  # each episode gets the same replies, step by step
    assert all(r.turns == 2 and r.error is None for r in records)


async def test_a_malformed_call_is_answered_with_an_error_the_model_sees() -> None:
    class Fumbler:
        """Writes one unreadable call (as a server's parser reports it), then answers."""

        name = "fumbler"

        def __init__(self) -> None:
            self.seen: list[ChatRequest] = []

        async def complete(self, request: ChatRequest) -> Completion:
            self.seen.append(request)
            if request.step_no == 0:
                return Completion(HERMES.parse('<tool_call>{"name": lookup}</tool_call>').message())
            return Completion(assistant_message("", [ToolCall("c1", "answer", '{"value": "s1"}')]))

        async def close(self) -> None:
            return None

    client = Fumbler()
    [record] = await run_eval(secrets_registry(), [("test/secrets", 1)], client, ScoringContext())
    assert record.error is None and record.reward == 1.0 and record.turns == 2
    calls = record.transcript[2]["tool_calls"]
    assert [call["function"]["name"] for call in calls] == [MALFORMED_TOOL]
    error = client.seen[1].messages[-1]
    assert error["role"] == "tool" and error["content"].startswith("error: your tool call could not be read")


@pytest.fixture
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tether.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=0)


async def test_the_in_process_engine_evaluates_concurrent_episodes(tiny_folder: Path, tmp_path: Path) -> None:
    from tether.serving.engine_client import EngineClient

    client = EngineClient(str(tiny_folder), tmp_path, kv_cache_mib=16, device="cpu")
    plan = [("math/fractions", seed) for seed in range(3)]
    try:
        records = await run_eval(registry(), plan, client, ScoringContext(), EvalSettings(max_tokens=4))
    finally:
        await client.close()
    assert all(r.error is None and r.turns == 1 for r in records)
    assert all(r.prompt_tokens > 0 and 0 < r.completion_tokens <= 4 for r in records)


async def test_the_in_process_engine_takes_tools(tiny_folder: Path, tmp_path: Path) -> None:
    from tether.serving.engine_client import EngineClient

    client = EngineClient(str(tiny_folder), tmp_path, kv_cache_mib=16, device="cpu")
    try:
        [record] = await run_eval(
            secrets_registry(), [("test/secrets", 2)], client, ScoringContext(), EvalSettings(max_tokens=8)
        )
    finally:
        await client.close()
    assert record.error is None and record.turns >= 1 and record.completion_tokens > 0
