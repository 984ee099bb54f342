"""The worker loop: bounded in-flight tasks under overload, poison tasks, nudging chatty models."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest_asyncio

from tests.agents.scripts import scripted, write_script
from tether.agents.runner import RunnerConfig, TaskRunner
from tether.agents.service import AgentsConfig, AgentStack
from tether.agents.task import Limits, TaskSpec
from tether.agents.worker import AgentWorker, WorkerConfig
from tether.chat import ChatRequest, Completion
from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec
from tether.store import TaskStatus
from tether.testing.scripted import ScriptedClient


@pytest_asyncio.fixture
async def stack(tmp_path: Path) -> AsyncIterator[AgentStack]:
    opened = AgentStack(
        replace(AgentsConfig.embedded(tmp_path / "agents"), visibility_timeout_s=5, lease_s=5)
    )
    yield opened
    await opened.close()


class Gauge(ScriptedClient):
    """Counts how many tasks are inside a model call at once."""

    def __init__(self, path: Path) -> None:
        super().__init__(scripted(path).replies)
        self.now = self.peak = 0

    async def complete(self, request: ChatRequest) -> Completion:
        self.now += 1
        self.peak = max(self.peak, self.now)
        await asyncio.sleep(0.05)
        self.now -= 1
        return await super().complete(request)


async def test_overload_waits_in_the_queue_and_in_flight_stays_bounded(
    stack: AgentStack, tmp_path: Path
) -> None:
    model = Gauge(write_script(tmp_path / "s.jsonl", steps=2))
    task_ids = [await stack.submit(TaskSpec(goal=f"g{n}")) for n in range(6)]
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=2)) as pool:
        runner = TaskRunner(stack.journal, stack.artifacts, pool, model, "w", RunnerConfig(lease_s=5))
        worker = AgentWorker(stack.bus, runner, WorkerConfig(max_in_flight=2, poll_s=0.2))
        await worker.serve(asyncio.Event(), exit_when_idle=True)
    assert model.peak == 2
    assert worker.finished == 6
    assert all(stack.journal.get_task(task_id).status is TaskStatus.SUCCEEDED for task_id in task_ids)


async def test_a_task_delivered_too_often_is_failed_not_retried_forever(
    stack: AgentStack, tmp_path: Path
) -> None:
    task_id = await stack.submit(TaskSpec(goal="g"))
    (delivery,) = await stack.bus.receive(1, wait_s=1)
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1)) as pool:
        model = scripted(write_script(tmp_path / "s.jsonl", steps=1))
        runner = TaskRunner(stack.journal, stack.artifacts, pool, model, "w", RunnerConfig(lease_s=5))
        worker = AgentWorker(stack.bus, runner, WorkerConfig(max_deliveries=3))
        await worker._handle(replace(delivery, attempt=4), asyncio.Event())
    task = stack.journal.get_task(task_id)
    assert task.status is TaskStatus.FAILED and "delivered 4 times without ending (max_deliveries=3)" in (
        task.error or ""
    )
    assert stack.journal.steps(task_id) == []


async def test_with_require_finish_a_chatty_reply_is_nudged_instead_of_ending(
    stack: AgentStack, tmp_path: Path
) -> None:
    script = tmp_path / "s.jsonl"
    lines = [
        {"content": "Hello! How can I help?"},
        {"tool_calls": [{"name": "finish", "arguments": {"summary": "ok"}}]},
    ]
    script.write_text("".join(json.dumps(line) + "\n" for line in lines))

    class Recording(ScriptedClient):
        def __init__(self, path: Path) -> None:
            super().__init__(scripted(path).replies)
            self.requests: list[ChatRequest] = []

        async def complete(self, request: ChatRequest) -> Completion:
            self.requests.append(request)
            return await super().complete(request)

    model = Recording(script)
    task_id = await stack.submit(TaskSpec(goal="g", require_finish=True, limits=Limits(max_steps=5)))
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1)) as pool:
        runner = TaskRunner(stack.journal, stack.artifacts, pool, model, "w", RunnerConfig(lease_s=5))
        assert await runner.run(task_id) is TaskStatus.SUCCEEDED
    assert len(stack.journal.steps(task_id)) == 2
    assert "called no tool" in model.requests[1].messages[-1]["content"]
