"""The acceptance run with the real engine (smollm2-135m-instruct on CPU): a complete, resumable transcript.

A 135M model rarely reaches the goal; what is checked is the machinery: every step committed with its
usage, a worker stopped mid-task, and a fresh worker continuing the same transcript after `resume`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tether.agents.runner import RunnerConfig, TaskRunner
from tether.agents.service import AgentsConfig, AgentStack
from tether.agents.task import Limits, TaskSpec
from tether.config import load_settings
from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec
from tether.serving.engine_client import EngineClient
from tether.store import StepStatus, TaskStatus


class StopAfter:
    """Wraps the real model and stops the run (like a killed worker) once `steps` model calls are made."""

    def __init__(self, model: EngineClient, steps: int) -> None:
        self.model, self.steps, self.name = model, steps, model.name

    async def complete(self, request):  # type: ignore[no-untyped-def]
        if request.step_no >= self.steps:
            raise asyncio.CancelledError
        return await self.model.complete(request)

    async def close(self) -> None:
        return None


@pytest.mark.slow
async def test_fizzbuzz_with_the_real_model_is_complete_and_resumable(tmp_path: Path) -> None:
    model = EngineClient("smollm2-135m-instruct", load_settings(None).cache_dir)
    stack = AgentStack(AgentsConfig.embedded(tmp_path / "agents"))
    spec = TaskSpec(
        goal="write fizzbuzz.py and test it",
        require_finish=True,
        limits=Limits(max_steps=4, max_output_tokens=96),
    )
    task_id = await stack.submit(spec)
    try:
        async with SandboxPool(SandboxSpec(timeout_s=20), PoolConfig(slots=1)) as pool:
            first = TaskRunner(
                stack.journal, stack.artifacts, pool, StopAfter(model, 2), "w1", RunnerConfig(lease_s=1)
            )  # type: ignore[arg-type]
            with pytest.raises(asyncio.CancelledError):
                await first.run(task_id)
            assert [s.step_no for s in stack.journal.steps(task_id)] == [0, 1]
            await stack.resume(task_id)
            second = TaskRunner(stack.journal, stack.artifacts, pool, model, "w2", RunnerConfig(lease_s=30))
            status = await second.run(task_id)
    finally:
        await model.close()
        await stack.close()
    assert status in (TaskStatus.SUCCEEDED, TaskStatus.FAILED)
    steps = stack.journal.steps(task_id)
    assert steps and all(step.status is StepStatus.COMMITTED for step in steps)
    assert all(step.usage["prompt_tokens"] > 0 for step in steps)
    assert {step.epoch for step in steps[:2]} != {
        step.epoch for step in steps[2:]
    }  # a second lease continued it
