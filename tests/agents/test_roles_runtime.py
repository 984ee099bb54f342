"""Planner -> coder -> reviewer -> coder -> reviewer -> done, with each hand-off travelling over the bus."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest_asyncio

from tests.agents.chaos import snapshot_files
from tests.agents.scripts import scripted
from tether.agents.roles import select_roles
from tether.agents.runner import RunnerConfig, TaskRunner
from tether.agents.service import AgentsConfig, AgentStack
from tether.agents.task import Limits, TaskSpec
from tether.agents.worker import AgentWorker, WorkerConfig
from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec
from tether.store import TaskStatus


def handoff(to: str, message: str) -> dict[str, object]:
    return {"name": "handoff", "arguments": {"to": to, "message": message}}


SCRIPT = [
    {"content": "plan: 1. write add.py", "tool_calls": [handoff("coder", "write add.py")]},
    {
        "content": "writing",
        "tool_calls": [
            {
                "name": "write_file",
                "arguments": {"path": "add.py", "content": "def add(a, b):\n    return a - b\n"},
            },
            handoff("reviewer", "please review"),
        ],
    },
    {
        "content": "reviewing",
        "tool_calls": [
            {"name": "shell", "arguments": {"command": "python3 -c 'import add; print(add.add(2, 2))'"}},
            handoff("coder", "add(2, 2) is 0, expected 4"),
        ],
    },
    {
        "content": "fixing; and trying to finish myself",
        "tool_calls": [
            {
                "name": "write_file",
                "arguments": {"path": "add.py", "content": "def add(a, b):\n    return a + b\n"},
            },
            {"name": "finish", "arguments": {"summary": "coders may not finish"}},
            handoff("reviewer", "fixed"),
        ],
    },
    {
        "content": "approved",
        "tool_calls": [
            {"name": "shell", "arguments": {"command": "python3 -c 'import add; print(add.add(2, 2))'"}},
            {"name": "finish", "arguments": {"summary": "add works"}},
        ],
    },
]


@pytest_asyncio.fixture
async def stack(tmp_path: Path) -> AsyncIterator[AgentStack]:
    opened = AgentStack(
        replace(AgentsConfig.embedded(tmp_path / "agents"), visibility_timeout_s=5, lease_s=5)
    )
    yield opened
    await opened.close()


async def test_roles_hand_the_task_around_until_the_reviewer_approves(
    stack: AgentStack, tmp_path: Path
) -> None:
    script = tmp_path / "roles.jsonl"
    script.write_text("".join(json.dumps(line) + "\n" for line in SCRIPT))
    task_id = await stack.submit(TaskSpec(goal="write add.py", roles=select_roles("planner,coder,reviewer")))
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1)) as pool:
        runner = TaskRunner(
            stack.journal,
            stack.artifacts,
            pool,
            scripted(script),
            "w",
            RunnerConfig(lease_s=5),
        )
        worker = AgentWorker(stack.bus, runner, WorkerConfig(max_in_flight=1, poll_s=0.2))
        await worker.serve(asyncio.Event(), exit_when_idle=True)
    task = stack.journal.get_task(task_id)
    assert task.status is TaskStatus.SUCCEEDED and task.result == "add works"
    steps = stack.journal.steps(task_id)
    assert [step.role for step in steps] == ["planner", "coder", "reviewer", "coder", "reviewer"]
    assert steps[2].tool_calls[0].observation["content"].endswith("stdout:\n0\n")  # type: ignore[index]
    refused = steps[3].tool_calls[1].observation or {}
    assert refused["error"] and refused["content"].startswith("unknown tool 'finish'; available: shell, ")
    assert steps[4].tool_calls[0].observation["content"].endswith("stdout:\n4\n")  # type: ignore[index]
    assert worker.finished == 1 and await stack.bus.depth() == 0
    assert snapshot_files(stack.artifacts, steps[-1].snapshot_key)["add.py"].endswith(b"a + b\n")


async def test_a_handoff_to_a_role_not_allowed_is_refused_and_the_role_keeps_the_task(
    stack: AgentStack, tmp_path: Path
) -> None:
    script = tmp_path / "skip.jsonl"
    lines = [
        {"tool_calls": [handoff("reviewer", "skip the coder")]},
        {"tool_calls": [handoff("coder", "write add.py")]},
    ]
    script.write_text("".join(json.dumps(line) + "\n" for line in lines))
    roles = select_roles("planner,coder,reviewer")
    task_id = await stack.submit(TaskSpec(goal="write add.py", roles=roles, limits=Limits(max_steps=2)))
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1)) as pool:
        runner = TaskRunner(stack.journal, stack.artifacts, pool, scripted(script), "w", RunnerConfig())
        assert await runner.run(task_id) is TaskStatus.QUEUED  # handed to the coder at step 1
    first, second = stack.journal.steps(task_id)
    assert first.tool_calls[0].observation == {
        "content": "cannot hand off to 'reviewer'; this role may hand off to: coder",
        "error": True,
    }
    assert first.tool_calls[0].executions == 0
    assert (first.role, second.role) == ("planner", "planner")
