"""Each built-in tool in a real sandbox session, and the same tool objects behind an RL episode and a hosted
agent task."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tether.agents.runner import RunnerConfig, TaskRunner
from tether.agents.service import AgentsConfig, AgentStack
from tether.agents.task import TaskSpec
from tether.chat import ToolCall, ToolResult, assistant_message
from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.episode import Environment, run_episode, scripted_policy
from tether.envs.parsers import ANSWER_TAG
from tether.envs.rubric import answer_rubric
from tether.envs.tasks import ChatRenderer, Problem
from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec
from tether.store import TaskStatus
from tether.testing.scripted import ScriptedClient
from tether.tools import BUILTIN_TOOLS, PYTHON, READ_FILE, SHELL, SUBMIT, WRITE_FILE, SandboxWorkspace


@pytest_asyncio.fixture
async def workspace() -> AsyncIterator[SandboxWorkspace]:
    async with (
        SandboxPool(SandboxSpec(timeout_s=3), PoolConfig(slots=1)) as pool,
        await pool.open_session() as session,
    ):
        yield SandboxWorkspace(session)


async def run(workspace: SandboxWorkspace, name: str, **arguments: str) -> tuple[ToolResult, bool]:
    return await BUILTIN_TOOLS.call(workspace, ToolCall(f"call_{name}", name, json.dumps(arguments)))


async def test_files_written_by_one_tool_are_seen_by_the_others(workspace: SandboxWorkspace) -> None:
    written, _ = await run(workspace, "write_file", path="src/a.txt", content="héllo\n")
    assert not written.error and written.content == "wrote 7 bytes to src/a.txt"
    shell, _ = await run(workspace, "shell", command="cat src/a.txt; echo more >> src/a.txt")
    assert not shell.error and shell.content == "status: ok\nexit code: 0\nstdout:\nhéllo\n"
    python, _ = await run(workspace, "python", code="print(open('src/a.txt').read().upper(), end='')")
    assert not python.error and python.content.endswith("stdout:\nHÉLLO\nMORE\n")
    read, _ = await run(workspace, "read_file", path="src/a.txt")
    assert not read.error and read.content == "héllo\nmore\n"
    assert read.message()["tool_call_id"] == "call_read_file"


@pytest.mark.parametrize(
    ("name", "arguments", "shown"),
    [
        (
            "shell",
            {"command": "echo oops >&2; exit 3"},
            "status: runtime_error\nexit code: 3\nstderr:\noops\n",
        ),
        ("python", {"code": "raise SystemExit(4)"}, "exit code: 4"),
        ("read_file", {"path": "missing.txt"}, "no such file: missing.txt"),
        ("write_file", {"path": "../outside.txt", "content": "x"}, "cannot write '../outside.txt'"),
        ("read_file", {"path": "/etc/passwd"}, "cannot read '/etc/passwd'"),
    ],
)
async def test_failed_calls_are_error_results_the_model_reads(
    workspace: SandboxWorkspace, name: str, arguments: dict[str, str], shown: str
) -> None:
    result, ends = await run(workspace, name, **arguments)
    assert result.error and not ends
    assert shown in result.content


async def test_a_run_past_its_time_limit_is_an_error_result(workspace: SandboxWorkspace) -> None:
    result, _ = await run(workspace, "shell", command="sleep 20")
    assert result.error and result.content.startswith("status: timeout")


async def test_finish_ends_with_its_summary_and_handoff_names_the_next_role(
    workspace: SandboxWorkspace,
) -> None:
    finished, ends = await run(workspace, "finish", summary="all tests pass")
    assert ends and finished.content == "all tests pass"
    handed, ends = await run(workspace, "handoff", to="reviewer", message="check it")
    assert not ends and handed.content == "handed off to reviewer"


async def test_a_snapshot_brings_back_the_files_it_holds(workspace: SandboxWorkspace) -> None:
    await run(workspace, "write_file", path="keep.txt", content="v1")
    snapshot = await workspace.snapshot()
    assert snapshot == await workspace.snapshot()  # deterministic: same files, same bytes
    await run(workspace, "shell", command="rm keep.txt && echo junk > junk.txt")
    await workspace.restore(snapshot)
    listing, _ = await run(workspace, "shell", command="ls; cat keep.txt")
    assert "keep.txt" in listing.content and "v1" in listing.content


CALLS = [
    ("write_file", {"path": "notes.txt", "content": "v1\n"}),
    ("shell", {"command": "cat notes.txt; echo v2 >> notes.txt"}),
    ("read_file", {"path": "notes.txt"}),
    ("python", {"code": "print(len(open('notes.txt').read()))"}),
]


class Source:
    def problem(self, seed: int) -> Problem:
        return Problem("Take notes.", "done")


async def episode_results() -> list[str]:
    env = Environment(
        "test/notes",
        Source(),
        ChatRenderer("Take notes with the tools."),
        ANSWER_TAG,
        answer_rubric(lambda inp: 1.0),
        tools=(WRITE_FILE, SHELL, READ_FILE, PYTHON, SUBMIT),
        max_turns=len(CALLS) + 1,
    )
    calls = [*CALLS, ("submit", {"answer": "done"})]
    replies = [
        assistant_message("", [ToolCall(f"c{n}", name, json.dumps(arguments))])
        for n, (name, arguments) in enumerate(calls)
    ]
    async with SandboxProvider(config=PoolConfig(slots=1)) as provider:
        result = await run_episode(env, env.task(0), scripted_policy(replies), ScoringContext(provider))
    assert result.score.answer == "done"
    return [m["content"] for m in result.messages if m["role"] == "tool"][: len(CALLS)]


async def agent_results(root: Path) -> list[str]:
    stack = AgentStack(AgentsConfig.embedded(root))
    lines = [{"tool_calls": [{"name": name, "arguments": arguments}]} for name, arguments in CALLS]
    client = ScriptedClient([*lines, {"tool_calls": [{"name": "finish", "arguments": {"summary": "ok"}}]}])
    try:
        task_id = await stack.submit(TaskSpec(goal="take notes"))
        async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1)) as pool:
            runner = TaskRunner(stack.journal, stack.artifacts, pool, client, "w", RunnerConfig())
            assert runner.tools is BUILTIN_TOOLS and runner.tools.get("shell") is SHELL
            assert await runner.run(task_id) is TaskStatus.SUCCEEDED
        steps = stack.journal.steps(task_id)
        return [str((call.observation or {})["content"]) for step in steps[:-1] for call in step.tool_calls]
    finally:
        await stack.close()


async def test_an_episode_and_an_agent_task_get_the_same_results_from_the_same_tools(tmp_path: Path) -> None:
    from_episode = await episode_results()
    assert from_episode[1] == "status: ok\nexit code: 0\nstdout:\nv1\n"
    assert from_episode == await agent_results(tmp_path / "agents")
