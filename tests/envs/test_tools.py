"""Episodes calling the built-in tools (`tether.tools`) in a real sandbox session."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest_asyncio

from tether.chat import ToolCall
from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.episode import Environment, run_episode, scripted_policy
from tether.envs.parsers import ANSWER_TAG
from tether.envs.rubric import answer_rubric
from tether.envs.scoring import EpisodeState
from tether.envs.tasks import ChatRenderer, Problem
from tether.sandbox.pool import PoolConfig
from tether.tools import PYTHON, SHELL, SUBMIT


class Source:
    def problem(self, seed: int) -> Problem:
        return Problem("What is in secret.txt?", f"secret-{seed}", {})


async def plant_secret(state: EpisodeState) -> None:
    await state.require_session().upload({"secret.txt": state.task.reference})


def env() -> Environment:
    return Environment(
        "test/sandbox",
        Source(),
        ChatRenderer("s"),
        ANSWER_TAG,
        answer_rubric(lambda inp: 1.0 if inp.parsed.answer == inp.task.reference else 0.0),
        tools=(PYTHON, SHELL, SUBMIT),
        max_turns=5,
        setup=plant_secret,
    )


def reply(name: str, **arguments: str) -> dict[str, object]:
    call = ToolCall("c", name, json.dumps(arguments))
    return {"role": "assistant", "content": None, "tool_calls": [call.openai()]}


@pytest_asyncio.fixture
async def ctx() -> AsyncIterator[ScoringContext]:
    async with SandboxProvider(config=PoolConfig(slots=1)) as provider:
        yield ScoringContext(provider)


async def test_files_persist_between_python_and_shell_calls(ctx: ScoringContext) -> None:
    environment = env()
    task = environment.task(9)
    replies = [
        reply("shell", command="cat secret.txt > copy.txt && echo done"),
        reply("python", code="print(open('copy.txt').read().upper())"),
        reply("submit", answer="secret-9"),
    ]
    result = await run_episode(environment, task, scripted_policy(replies), ctx)
    outputs = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert "stdout:\ndone" in outputs[0]
    assert "SECRET-9" in outputs[1]
    assert result.score.total == 1.0
    assert result.score.sandbox_time_s > 0


async def test_a_failing_program_reports_its_status_to_the_model(ctx: ScoringContext) -> None:
    environment = env()
    episode = await environment.start(environment.task(1), ctx)
    async with episode:
        results = await episode.step(reply("python", code="raise SystemExit(3)"))
        assert "status: runtime_error" in results[0]["content"]
        assert "exit code: 3" in results[0]["content"]
        results = await episode.step(reply("shell", command=""))
        assert results[0]["content"].startswith("status: ok")
        results = await episode.step(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [ToolCall("c", "python", json.dumps({"code": 5})).openai()],
            }
        )
        assert "code: 5 is not of type 'string'" in results[0]["content"]


async def test_each_episode_gets_a_fresh_session(ctx: ScoringContext) -> None:
    environment = env()
    first = [reply("shell", command="echo left > junk.txt"), reply("submit", answer="x")]
    await run_episode(environment, environment.task(1), scripted_policy(first), ctx.child())
    second = [reply("shell", command="ls"), reply("submit", answer="x")]
    result = await run_episode(environment, environment.task(2), scripted_policy(second), ctx.child())
    listing = result.messages[3]["content"]
    assert "secret.txt" in listing and "junk.txt" not in listing
