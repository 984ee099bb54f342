"""The runner end to end on a real sandbox and journal: steps, checkpoints, resume after failures."""

from __future__ import annotations

import asyncio
import io
import json
import tarfile
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
import pytest_asyncio

from tests.agents.scripts import expected_effects, scripted, write_script
from tether.agents.replay import OUTCOME_UNKNOWN
from tether.agents.runner import RunnerConfig, TaskRunner
from tether.agents.service import AgentsConfig, AgentStack
from tether.agents.task import Limits, RoleSpec, TaskSpec
from tether.agents.worker import AgentWorker, WorkerConfig
from tether.chat import ChatRequest, Completion, JsonDict, ToolSpec, tool_calls_of
from tether.chat.completion import ModelError
from tether.chat.tool_format import HERMES
from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec
from tether.store import StepStatus, TaskStatus
from tether.store.artifacts import ArtifactStore
from tether.testing.scripted import ScriptedClient
from tether.tools import BUILTIN_TOOLS, SHELL, ReplayPolicy, Tool, Toolbox, Workspace


def snapshot_files(artifacts: ArtifactStore, key: str | None) -> dict[str, bytes]:
    assert key is not None
    with tarfile.open(fileobj=io.BytesIO(artifacts.get(key))) as archive:
        return {
            member.name.removeprefix("./"): archive.extractfile(member).read()  # type: ignore[union-attr]
            for member in archive.getmembers()
            if member.isfile()
        }


@pytest_asyncio.fixture
async def stack(tmp_path: Path) -> AsyncIterator[AgentStack]:
    opened = AgentStack(
        replace(AgentsConfig.embedded(tmp_path / "agents"), visibility_timeout_s=2, lease_s=2)
    )
    yield opened
    await opened.close()


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[SandboxPool]:
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=2)) as running:
        yield running


def runner_for(
    stack: AgentStack, pool: SandboxPool, model: object, tools: Toolbox | None = None
) -> TaskRunner:
    return TaskRunner(
        stack.journal,
        stack.artifacts,
        pool,
        model,
        "w-test",
        RunnerConfig(lease_s=2),
        tools=tools,  # type: ignore[arg-type]
    )


async def drain(stack: AgentStack, runner: TaskRunner) -> None:
    await AgentWorker(stack.bus, runner, WorkerConfig(poll_s=0.2)).serve(asyncio.Event(), exit_when_idle=True)


async def test_a_task_runs_to_the_end_with_every_step_committed(
    stack: AgentStack, pool: SandboxPool, tmp_path: Path
) -> None:
    model = scripted(write_script(tmp_path / "script.jsonl", steps=5))
    task_id = await stack.submit(TaskSpec(goal="write notes", files={"seed.txt": "x"}))
    await drain(stack, runner_for(stack, pool, model))
    task = stack.journal.get_task(task_id)
    assert task.status is TaskStatus.SUCCEEDED and task.result == "ok"
    steps = stack.journal.steps(task_id)
    assert [step.step_no for step in steps] == list(range(6))
    assert all(step.status is StepStatus.COMMITTED for step in steps)
    assert all(call.executions == 1 and call.observation is not None for s in steps for call in s.tool_calls)
    files = snapshot_files(stack.artifacts, steps[-1].snapshot_key)
    assert files["effects.log"].decode() == expected_effects(5)
    assert files["seed.txt"] == b"x" and files["notes/1.txt"] == b"v4"
    assert await stack.bus.depth() == 0


class CrashOnce:
    """Wraps a tool: the first call does the real work, then fails as if the worker died right after."""

    def __init__(self, tool: Tool, crash_key: str) -> None:
        self.tool, self.crash_key, self.crashed = tool, crash_key, False

    async def __call__(self, workspace: Workspace, arguments: JsonDict, key: str) -> str:
        observation = await self.tool.function(workspace, arguments, key)
        if key == self.crash_key and not self.crashed:
            self.crashed = True
            raise ModelError("simulated worker death after the effect, before the commit")
        return observation


@pytest.mark.parametrize("snapshot_every", [1, 3])
async def test_a_crash_after_a_side_effect_does_not_repeat_it_on_resume(
    stack: AgentStack, pool: SandboxPool, tmp_path: Path, snapshot_every: int
) -> None:
    model = scripted(write_script(tmp_path / "script.jsonl", steps=7))
    task_id = await stack.submit(TaskSpec(goal="g", snapshot_every=snapshot_every), task_id="crashy")
    crash = CrashOnce(SHELL, "crashy:4:0")
    tools = Toolbox(replace(tool, function=crash) if tool is SHELL else tool for tool in BUILTIN_TOOLS)
    runner = runner_for(stack, pool, model, tools)
    with pytest.raises(ModelError, match="simulated worker death"):
        await runner.run(task_id)
    interrupted = stack.journal.steps(task_id)
    assert interrupted[-1].step_no == 4 and interrupted[-1].status is StepStatus.PLANNED
    assert interrupted[-1].tool_calls[0].executions == 1 and interrupted[-1].tool_calls[0].observation is None

    assert await runner.run(task_id) is TaskStatus.SUCCEEDED
    steps = stack.journal.steps(task_id)
    assert [step.step_no for step in steps] == list(range(8))
    assert steps[4].tool_calls[0].executions == 2  # ran again on the restored workdir; its effect counts once
    files = snapshot_files(stack.artifacts, steps[-1].snapshot_key)
    assert files["effects.log"].decode() == expected_effects(7)
    snapshots = [step.snapshot_key is not None for step in steps]
    assert snapshots == [(n + 1) % snapshot_every == 0 or n == 7 for n in range(8)]


class FailingModel:
    """Answers from a script but fails once at one step, as a flaky endpoint would."""

    def __init__(self, inner: ScriptedClient, fail_at: int) -> None:
        self.inner, self.fail_at, self.name, self.calls = inner, fail_at, "flaky", 0

    async def complete(self, request: ChatRequest) -> Completion:
        self.calls += 1
        if request.step_no == self.fail_at and self.calls == self.fail_at + 1:
            raise ModelError("HTTP 503")
        return await self.inner.complete(request)

    async def close(self) -> None:
        return None


async def test_a_failed_model_call_resumes_at_that_step_without_redoing_earlier_ones(
    stack: AgentStack, pool: SandboxPool, tmp_path: Path
) -> None:
    model = FailingModel(scripted(write_script(tmp_path / "script.jsonl", steps=4)), fail_at=2)
    task_id = await stack.submit(TaskSpec(goal="g"))
    runner = runner_for(stack, pool, model)
    with pytest.raises(ModelError):
        await runner.run(task_id)
    assert [step.step_no for step in stack.journal.steps(task_id)] == [0, 1]
    assert await runner.run(task_id) is TaskStatus.SUCCEEDED
    assert model.calls == 6  # steps 0-4 once each, plus the failed attempt at step 2
    files = snapshot_files(stack.artifacts, stack.journal.steps(task_id)[-1].snapshot_key)
    assert files["effects.log"].decode() == expected_effects(4)


@pytest.mark.parametrize(
    ("limits", "error"),
    [
        (Limits(max_steps=3), "step budget exhausted: 3 of max_steps=3"),
        (Limits(max_tokens=1), "token budget exhausted"),
    ],
)
async def test_budgets_stop_a_task(
    stack: AgentStack, pool: SandboxPool, tmp_path: Path, limits: Limits, error: str
) -> None:
    model = scripted(write_script(tmp_path / "script.jsonl", steps=10))
    task_id = await stack.submit(TaskSpec(goal="g", limits=limits))
    assert await runner_for(stack, pool, model).run(task_id) is TaskStatus.FAILED
    assert error in (stack.journal.get_task(task_id).error or "")


async def test_bad_tool_calls_become_observations_the_model_can_read(
    stack: AgentStack, pool: SandboxPool, tmp_path: Path
) -> None:
    script = tmp_path / "script.jsonl"
    script.write_text(
        '{"tool_calls": [{"name": "rm_rf", "arguments": {}}, '
        '{"name": "shell", "arguments": {"cmd": "ls"}}]}\n'
        '{"content": "giving up"}\n'
    )
    task_id = await stack.submit(TaskSpec(goal="g"))
    assert await runner_for(stack, pool, scripted(script)).run(task_id) is TaskStatus.SUCCEEDED
    first = stack.journal.steps(task_id)[0]
    assert first.tool_calls[0].observation == {
        "content": "unknown tool 'rm_rf'; available: shell, python, write_file, read_file, finish",
        "error": True,
    }
    refused = first.tool_calls[1].observation or {}
    assert refused["error"] and "'command' is a required property" in refused["content"]
    assert (
        "('cmd' was unexpected)" in refused["content"]
        and "accepted: command (string, required)" in refused["content"]
    )
    assert all(call.executions == 0 for call in first.tool_calls)


async def test_a_call_the_parser_could_not_read_is_answered_with_its_error(
    stack: AgentStack, pool: SandboxPool, tmp_path: Path
) -> None:
    """What an engine's tool-call parser gives for a broken block (`tether.chat.tool_format`)."""
    reply = HERMES.parse('<tool_call>{"name": "shell", "arguments": {"command": "ls"</tool_call>').message()
    (broken,) = tool_calls_of(reply)
    line = {"tool_calls": [{"name": broken.name, "arguments": broken.parsed_arguments()}]}
    script = tmp_path / "s.jsonl"
    script.write_text(json.dumps(line) + "\n" + '{"content": "giving up"}\n')
    task_id = await stack.submit(TaskSpec(goal="g"))
    assert await runner_for(stack, pool, scripted(script)).run(task_id) is TaskStatus.SUCCEEDED
    (call,) = stack.journal.steps(task_id)[0].tool_calls
    observation = call.observation or {}
    assert observation["error"] and call.executions == 0
    assert observation["content"].startswith("error: your tool call could not be read (not valid JSON")


async def test_cancel_stops_a_queued_task_before_it_runs(
    stack: AgentStack, pool: SandboxPool, tmp_path: Path
) -> None:
    model = scripted(write_script(tmp_path / "script.jsonl", steps=3))
    task_id = await stack.submit(TaskSpec(goal="g"))
    stack.journal.request_cancel(task_id)
    await drain(stack, runner_for(stack, pool, model))
    assert stack.journal.get_task(task_id).status is TaskStatus.CANCELLED
    assert stack.journal.steps(task_id) == []
    assert await stack.bus.depth() == 0


class Ledger:
    """An external system (outside the sandbox) that the test can inspect: every effect it received."""

    def __init__(self) -> None:
        self.effects: list[str] = []
        self.die_once = True

    def tool(self, policy: ReplayPolicy, dedupe: bool) -> Tool:
        async def pay(_workspace: Workspace, arguments: JsonDict, key: str) -> str:
            if not (dedupe and key in self.effects):
                self.effects.append(key)
            if self.die_once:
                self.die_once = False
                raise ModelError("simulated worker death while the external call was in flight")
            return f"paid {arguments['amount']}"

        parameters = {"type": "object", "properties": {"amount": {}}, "required": ["amount"]}
        return Tool(ToolSpec("pay", "Pay someone.", parameters), pay, policy)


@pytest.mark.parametrize(
    ("policy", "dedupe", "observation"),
    [
        (ReplayPolicy.EXTERNAL_AT_MOST_ONCE, False, OUTCOME_UNKNOWN),
        (ReplayPolicy.EXTERNAL_IDEMPOTENT, True, {"content": "paid 5", "error": False}),
    ],
)
async def test_external_effects_happen_once_across_a_crash_mid_call(
    stack: AgentStack,
    pool: SandboxPool,
    tmp_path: Path,
    policy: ReplayPolicy,
    dedupe: bool,
    observation: JsonDict,
) -> None:
    script = tmp_path / "s.jsonl"
    script.write_text(
        '{"tool_calls": [{"name": "pay", "arguments": {"amount": "5"}}]}\n'
        '{"tool_calls": [{"name": "finish", "arguments": {"summary": "paid"}}]}\n'
    )
    ledger = Ledger()
    tools = Toolbox((*BUILTIN_TOOLS, ledger.tool(policy, dedupe)))
    spec = TaskSpec(goal="pay 5", roles=(RoleSpec(name="agent", tools=("pay", "finish")),))
    task_id = await stack.submit(spec, task_id="payer")
    runner = runner_for(stack, pool, scripted(script), tools)
    with pytest.raises(ModelError, match="in flight"):
        await runner.run(task_id)
    assert await runner.run(task_id) is TaskStatus.SUCCEEDED
    (call,) = stack.journal.steps(task_id)[0].tool_calls
    assert call.observation == observation
    assert ledger.effects == ["payer:0:0"]  # the effect happened once, whatever the policy
    assert call.executions == (1 if policy is ReplayPolicy.EXTERNAL_AT_MOST_ONCE else 2)


class Stalls(ScriptedClient):
    """Blocks inside the model call of one step until released, like a worker frozen by a long GC pause."""

    def __init__(self, path: Path, at_step: int) -> None:
        super().__init__(scripted(path).replies)
        self.at_step, self.stalled, self.release = at_step, asyncio.Event(), asyncio.Event()

    async def complete(self, request: ChatRequest) -> Completion:
        if request.step_no == self.at_step:
            self.stalled.set()
            await self.release.wait()
        return await super().complete(request)


async def test_a_stalled_worker_that_was_taken_over_writes_nothing_more(
    stack: AgentStack, pool: SandboxPool, tmp_path: Path
) -> None:
    script = write_script(tmp_path / "s.jsonl", steps=4)
    task_id = await stack.submit(TaskSpec(goal="g"))
    stalled = Stalls(script, at_step=2)
    first = asyncio.create_task(runner_for(stack, pool, stalled).run(task_id))
    await asyncio.wait_for(stalled.stalled.wait(), 30)
    stack.journal.requeue(task_id)  # an operator's `agent resume`: take the task over now
    second = TaskRunner(
        stack.journal, stack.artifacts, pool, scripted(script), "w-2", RunnerConfig(lease_s=2)
    )
    assert await second.run(task_id) is TaskStatus.SUCCEEDED
    stalled.release.set()
    assert await first is None  # fenced out: its step-2 append failed with LeaseLost
    steps = stack.journal.steps(task_id)
    assert [step.step_no for step in steps] == list(range(5))
    assert [step.epoch for step in steps] == [1, 1, 2, 2, 2]
    assert snapshot_files(stack.artifacts, steps[-1].snapshot_key)[
        "effects.log"
    ].decode() == expected_effects(4)
