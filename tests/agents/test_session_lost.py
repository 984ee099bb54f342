"""A task whose sandbox session is lost mid-step (its fleet instance died) resumes at once in a new
session from the last committed snapshot, journaled like a crash resumption: no step lost or doubled."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.agents.scripts import expected_effects, scripted, write_script
from tests.agents.test_runner import snapshot_files
from tether.agents.runner import RunnerConfig, TaskRunner
from tether.agents.service import AgentsConfig, AgentStack
from tether.agents.task import TaskSpec
from tether.sandbox import PoolConfig, RunResult, SandboxPool, SandboxSpec, Session, SessionLost
from tether.store import StepStatus, TaskStatus


class LosingSession:
    """A real session that is lost (its directory discarded, every call refused) at call `lose_at`."""

    def __init__(self, inner: Session, lose_at: int | None) -> None:
        self.inner, self.lose_at, self.calls = inner, lose_at, 0

    @property
    def id(self) -> str:
        return self.inner.id

    async def _tick(self) -> None:
        self.calls += 1
        if self.lose_at is not None and self.calls >= self.lose_at:
            await self.inner.close()
            raise SessionLost(self.id, "http://sandbox-1:8080", "ConnectError: connection refused")

    async def run(self, code: str | bytes, language: str = "python", **kwargs: Any) -> RunResult:
        await self._tick()
        return await self.inner.run(code, language, **kwargs)

    async def upload(self, files: Mapping[str, str | bytes]) -> None:
        await self._tick()
        await self.inner.upload(files)

    async def download(self, paths: Sequence[str]) -> dict[str, bytes]:
        await self._tick()
        return await self.inner.download(paths)

    async def close(self) -> None:
        await self.inner.close()

    async def __aenter__(self) -> LosingSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class LosingSandbox:
    """The pool, whose sessions are lost at the given call numbers, one per session opened."""

    def __init__(self, pool: SandboxPool, lose_at: list[int | None]) -> None:
        self.pool, self.lose_at, self.opened = pool, list(lose_at), 0

    @property
    def spec(self) -> SandboxSpec:
        return self.pool.spec

    async def start(self) -> None: ...

    async def run(self, code: str | bytes, language: str = "python", **kwargs: Any) -> RunResult:
        return await self.pool.run(code, language, **kwargs)

    async def open_session(self, spec: SandboxSpec | None = None, client: str = "") -> LosingSession:
        self.opened += 1
        lose_at = self.lose_at.pop(0) if self.lose_at else None
        return LosingSession(await self.pool.open_session(spec, client), lose_at)

    async def close(self) -> None: ...


@pytest.mark.parametrize(
    "lose_at",
    [
        [9],  # mid-step 2: its shell call ran (journaled as started) and the session went
        [9, 4],  # lost again right after the restore: resumed again
    ],
)
async def test_a_lost_session_is_restored_from_the_last_snapshot_and_the_task_completes(
    tmp_path: Path, lose_at: list[int | None]
) -> None:
    stack = AgentStack(replace(AgentsConfig.embedded(tmp_path / "agents"), lease_s=5))
    try:
        async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1)) as pool:
            sandbox = LosingSandbox(pool, lose_at)
            model = scripted(write_script(tmp_path / "script.jsonl", steps=4))
            config = RunnerConfig(lease_s=5)
            runner = TaskRunner(stack.journal, stack.artifacts, sandbox, model, "w", config)
            task_id = await stack.submit(TaskSpec(goal="write notes", files={"seed.txt": "x"}))
            status = await runner.run(task_id)
            assert not pool.sessions  # every session, lost or not, gave its slot back
    finally:
        await stack.close()
    assert status is TaskStatus.SUCCEEDED and sandbox.opened == len(lose_at) + 1
    task = stack.journal.get_task(task_id)
    assert task.lease_epoch == len(lose_at) + 1  # each loss: a new epoch, as after a crash
    steps = stack.journal.steps(task_id)
    assert all(step.status is StepStatus.COMMITTED for step in steps) and len(steps) == 5
    assert steps[0].epoch == 1 and steps[-1].epoch == len(lose_at) + 1
    assert max(call.executions for step in steps for call in step.tool_calls) >= 2  # re-run there
    files = snapshot_files(stack.artifacts, steps[-1].snapshot_key)
    assert files["effects.log"].decode() == expected_effects(4)  # every effect exactly once
    assert files["seed.txt"] == b"x"


async def test_a_session_lost_more_often_than_allowed_is_raised(tmp_path: Path) -> None:
    stack = AgentStack(AgentsConfig.embedded(tmp_path / "agents"))
    try:
        async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1)) as pool:
            sandbox = LosingSandbox(pool, [1, 1, 1])
            model = scripted(write_script(tmp_path / "script.jsonl", steps=2))
            config = RunnerConfig(lease_s=5, max_session_losses=2)
            runner = TaskRunner(stack.journal, stack.artifacts, sandbox, model, "w", config)
            task_id = await stack.submit(TaskSpec(goal="g", files={"seed.txt": "x"}))
            with pytest.raises(SessionLost, match="sandbox-1:8080"):
                await runner.run(task_id)
    finally:
        await stack.close()
    assert sandbox.opened == 3
