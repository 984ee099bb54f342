"""Evaluation: planning, batching, per-domain summaries, and the two model backends."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tether.chat import Messages, ToolCall
from tether.envs import math as math_envs
from tether.envs import structured
from tether.envs.context import ScoringContext
from tether.envs.errors import EnvError
from tether.envs.parsers import ANSWER_TAG
from tether.envs.registry import EnvRegistry, Mixture
from tether.envs.rubric import hedged
from tether.eval.runner import (
    Conversation,
    EngineBackend,
    EpisodeRecord,
    Generation,
    OpenAIBackend,
    Ready,
    plan_episodes,
    run_eval,
    summarise,
    text_convention,
)


def registry() -> EnvRegistry:
    registry = EnvRegistry()
    math_envs.register(registry)
    structured.register(registry)
    return registry


class Oracle:
    """Answers every task with its reference (looked up by the user prompt), or with a wrong answer."""

    def __init__(
        self, registry: EnvRegistry, plan: list[tuple[str, int]], wrong: set[str] = frozenset()
    ) -> None:
        self.answers: dict[str, str] = {}
        for name, seed in plan:
            task = registry.get(name).task(seed)
            answer = "<answer>nope</answer>" if name in wrong else ANSWER_TAG.format(task.reference)
            self.answers[task.messages[1]["content"]] = answer
        self.batches: list[int] = []

    async def generate(
        self, conversations: list[Conversation], ready: Ready | None = None
    ) -> list[Generation]:
        self.batches.append(len(conversations))
        return [
            Generation({"role": "assistant", "content": self.answers[m[1]["content"]]}, 10, 5)
            for m, _ in conversations
        ]


def test_plans_give_n_per_environment_or_n_in_all() -> None:
    mixture = Mixture((("a/x", 1.0), ("b/y", 3.0)))
    assert plan_episodes(mixture, 2, 10, per_env=True) == [("a/x", 10), ("a/x", 11), ("b/y", 10), ("b/y", 11)]
    assert [name for name, _ in plan_episodes(mixture, 4, 0, per_env=False)] == ["a/x", "b/y", "b/y", "b/y"]
    with pytest.raises(EnvError, match="at least 1"):
        plan_episodes(mixture, 0, 0, per_env=True)


async def test_an_oracle_scores_one_everywhere_and_requests_are_batched() -> None:
    reg = registry()
    plan = plan_episodes(Mixture((("math/fractions", 1.0), ("structured/person", 1.0))), 5, 0, per_env=True)
    oracle = Oracle(reg, plan)
    done: list[EpisodeRecord] = []
    records = await run_eval(reg, plan, oracle, ScoringContext(), concurrency=8, on_done=done.append)
    assert [r.reward for r in records] == [1.0] * 10 and len(done) == 10
    assert max(oracle.batches) > 1 and sum(oracle.batches) == 10
    rows = {row.env: row for row in summarise(records)}
    assert rows["math/fractions"].pass_rate == 1.0 and rows["math/fractions"].mean_completion_tokens == 5
    assert rows["structured/person"].components["schema"] == 1.0
    record = records[0].to_dict()
    assert (
        record["transcript"][-1]["role"] == "assistant"
        and record["score"]["components"]["correctness"] == 1.0
    )
    json.dumps(record)


async def test_summaries_separate_domains_and_count_failures() -> None:
    reg = registry()
    plan = [("math/fractions", 0), ("math/fractions", 1), ("math/powers", 0)]
    oracle = Oracle(reg, plan, wrong={"math/powers"})
    rows = {row.env: row for row in summarise(await run_eval(reg, plan, oracle, ScoringContext()))}
    assert rows["math/fractions"].mean_reward == 1.0 and rows["math/powers"].mean_reward == 0.0
    assert rows["math/powers"].episodes == 1 and rows["math/powers"].errors == 0


async def test_a_backend_failure_is_recorded_per_episode_not_raised() -> None:
    class Broken:
        async def generate(
            self, conversations: list[Conversation], ready: Ready | None = None
        ) -> list[Generation]:
            raise RuntimeError("server down")

    records = await run_eval(
        registry(), [("math/fractions", 0), ("math/powers", 1)], Broken(), ScoringContext()
    )
    assert all(r.error == "RuntimeError: server down" and r.reward == 0.0 for r in records)
    assert summarise(records)[0].errors == 1


async def test_unknown_environments_fail_before_any_generation() -> None:
    with pytest.raises(EnvError, match="unknown environment"):
        await run_eval(registry(), [("math/nope", 0)], Oracle(registry(), []), ScoringContext())


def test_text_convention_puts_tools_in_the_system_prompt_and_results_in_user_turns() -> None:
    tools = [{"type": "function", "function": {"name": "python", "parameters": {}}}]
    call = ToolCall("c", "python", json.dumps({"code": "print(1)"})).openai()
    messages: Messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "look", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "1"},
    ]
    out = text_convention(messages, tools)
    assert out[0]["content"].startswith("sys\n\n") and '"name": "python"' in out[0]["content"]
    assert (
        out[2]["content"]
        == 'look<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    )
    assert out[3] == {"role": "user", "content": "<tool_response>\n1\n</tool_response>"}
    assert text_convention(messages[1:2], []) == [{"role": "user", "content": "q"}]


def _chat_handler(seen: list[dict[str, Any]]) -> Any:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append({"body": body, "auth": request.headers.get("authorization"), "path": request.url.path})
        if not any(m["role"] == "tool" for m in body["messages"]):
            call = {
                "id": "x1",
                "type": "function",
                "function": {"name": "submit", "arguments": '{"answer": "7"}'},
            }
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:
            message = {"role": "assistant", "content": "done"}
        usage = {"prompt_tokens": 12, "completion_tokens": 3}
        return httpx.Response(200, json={"choices": [{"message": message}], "usage": usage})

    return handle


async def test_the_openai_backend_sends_tools_and_returns_tool_calls() -> None:
    seen: list[dict[str, Any]] = []
    backend = OpenAIBackend(
        "http://server/v1/", "m", 64, 0.0, api_key="k", transport=httpx.MockTransport(_chat_handler(seen))
    )
    tools = [{"type": "function", "function": {"name": "submit", "parameters": {}}}]
    [generation] = await backend.generate([([{"role": "user", "content": "hi"}], tools)])
    await backend.aclose()
    assert generation.message["tool_calls"][0]["function"]["name"] == "submit"
    assert (generation.prompt_tokens, generation.completion_tokens) == (12, 3)
    assert seen[0]["path"] == "/v1/chat/completions" and seen[0]["auth"] == "Bearer k"
    assert seen[0]["body"]["tools"] == tools and seen[0]["body"]["max_tokens"] == 64


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (httpx.Response(500, text="boom"), "answered 500: boom"),
        (httpx.Response(200, json={"choices": []}), "no choices"),
        (httpx.Response(200, text="not json"), "no choices"),
    ],
)
async def test_openai_backend_errors_name_the_server_and_the_problem(
    response: httpx.Response, message: str
) -> None:
    backend = OpenAIBackend(
        "http://server/v1", "m", 8, 0.0, transport=httpx.MockTransport(lambda _: response)
    )
    with pytest.raises(EnvError, match=message):
        await backend.generate([([{"role": "user", "content": "hi"}], [])])
    await backend.aclose()


async def test_the_openai_backend_refuses_a_url_where_no_server_answers_and_takes_any_answer() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    dead = OpenAIBackend("http://dead:9/v1/", "m", 8, 0.0, transport=httpx.MockTransport(refuse))
    with pytest.raises(
        EnvError, match=r"no server answers at http://dead:9/v1 \(ConnectError: connection refused"
    ):
        await dead.check_reachable()
    await dead.aclose()
    alive = OpenAIBackend(
        "http://alive/v1", "m", 8, 0.0, transport=httpx.MockTransport(lambda _: httpx.Response(404))
    )
    await alive.check_reachable()  # a server without /models still answers
    await alive.aclose()


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from tether.engine.llm_engine import LLMEngine
    from tether.testing import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=0)
    return LLMEngine.from_pretrained(folder, kv_cache_mib=16)


async def test_the_engine_backend_decodes_a_batch_and_skips_prompts_that_do_not_fit(
    tiny_engine: tuple[Any, Any],
) -> None:
    from tether.engine.sampling import SamplingParams

    engine, tokenizer = tiny_engine
    backend = EngineBackend(engine, tokenizer, SamplingParams(max_tokens=6, temperature=0.0))
    short: Conversation = ([{"role": "user", "content": "hi"}], [])
    long: Conversation = ([{"role": "user", "content": "x" * (engine.config.max_model_len + 10)}], [])
    first, second, skipped = await backend.generate([short, short, long])
    assert first == second and first.completion_tokens == 6 and first.prompt_tokens > 0
    assert skipped.message == {"role": "assistant", "content": ""} and skipped.completion_tokens == 0


async def test_the_engine_backend_hands_over_each_reply_as_it_finishes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from tether.engine.llm_engine import LLMEngine
    from tether.engine.sampling import SamplingParams
    from tether.testing import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("short"), "llama", seed=0)
    engine, tokenizer = LLMEngine.from_pretrained(folder, kv_cache_mib=16, max_model_len=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    backend = EngineBackend(engine, tokenizer, params)
    short: Conversation = ([{"role": "user", "content": "hi"}], [])
    # A prompt 3 tokens short of the context: its reply stops after 3 tokens, the short one's after 12.
    words = next(
        n for n in range(60) if len(backend.encode(([{"role": "user", "content": "x " * n}], []))) >= 61
    )
    near_limit: Conversation = ([{"role": "user", "content": "x " * words}], [])
    assert len(backend.encode(near_limit)) == 61
    order: list[tuple[int, int]] = []
    generations = await backend.generate(
        [short, near_limit], lambda index, generation: order.append((index, generation.completion_tokens))
    )
    assert order == [(1, 3), (0, 12)]
    assert [g.completion_tokens for g in generations] == [12, 3]


async def test_an_episode_finishes_while_the_rest_of_its_batch_still_decodes() -> None:
    reg = registry()
    plan = [("math/fractions", 0), ("math/fractions", 1)]
    oracle = Oracle(reg, plan)
    first_done = asyncio.Event()

    class OneThenTheOther:
        async def generate(
            self, conversations: list[Conversation], ready: Ready | None = None
        ) -> list[Generation]:
            generations = await oracle.generate(conversations)
            assert ready is not None, "the batcher must ask to hear of each reply as it is ready"
            ready(0, generations[0])
            await asyncio.wait_for(first_done.wait(), timeout=5)  # the first episode ends meanwhile
            return generations

    done: list[int] = []

    def on_done(record: EpisodeRecord) -> None:
        done.append(record.seed)
        first_done.set()

    records = await run_eval(reg, plan, OneThenTheOther(), ScoringContext(), on_done=on_done)
    assert [r.reward for r in records] == [1.0, 1.0] and sorted(done) == [0, 1]


async def test_a_wrong_hedge_scores_zero_through_eval() -> None:
    reg = registry()
    task = reg.get("math/powers").task(3)

    class Hedger:
        async def generate(
            self, conversations: list[Conversation], ready: Ready | None = None
        ) -> list[Generation]:
            return [Generation({"role": "assistant", "content": hedged(ANSWER_TAG, task.reference)}, 1, 1)]

    [record] = await run_eval(reg, [("math/powers", 3)], Hedger(), ScoringContext())
    assert record.reward == 0.0 and record.error is None


async def test_multi_turn_episodes_run_from_text_tool_calls_through_the_sandbox() -> None:
    from tether.envs import finance
    from tether.envs.context import SandboxProvider
    from tether.envs.tools import parse_text_tool_calls
    from tether.sandbox.pool import PoolConfig

    reg = EnvRegistry()
    finance.register(reg)
    task = reg.get("finance/analyst").task(7)
    code = "print(open('data.csv').readline().strip())"

    class ToolUser:
        """Writes the text convention an in-process model would: read the file, then submit."""

        async def generate(
            self, conversations: list[Conversation], ready: Ready | None = None
        ) -> list[Generation]:
            replies = []
            for messages, tools in conversations:
                assert [tool["function"]["name"] for tool in tools] == ["python", "submit"]
                if messages[-1]["role"] == "tool":
                    call = {"name": "submit", "arguments": {"answer": task.reference}}
                else:
                    call = {"name": "python", "arguments": {"code": code}}
                text = f"<tool_call>{json.dumps(call)}</tool_call>"
                replies.append(Generation(parse_text_tool_calls(text), 1, 1))
            return replies

    async with SandboxProvider(config=PoolConfig(slots=1)) as provider:
        [record] = await run_eval(reg, [("finance/analyst", 7)], ToolUser(), ScoringContext(provider))
    assert record.error is None and record.turns == 2 and record.reward == 1.0
    assert record.transcript[3]["content"].endswith(task.data["csv"].splitlines()[0] + "\n")
    assert record.score is not None and record.score.sandbox_time_s > 0
