"""A task's success check runs in its workdir when it ends, decides its success, and is journaled."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tether.agents.check import CheckOutcome, run_check, tally, with_outcome, without_outcome
from tether.agents.runner import RunnerConfig, TaskRunner
from tether.agents.service import AgentsConfig, AgentStack
from tether.agents.task import CheckSpec, Limits, SuiteCheck, TaskSpec, build_task_spec
from tether.agents.timeline import task_line
from tether.chat import JsonDict
from tether.errors import ConfigError
from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec
from tether.store import TaskStatus
from tether.store.records import TaskRecord
from tether.testing.scripted import ScriptedClient

WRITE_DONE = {
    "content": "",
    "tool_calls": [{"name": "shell", "arguments": {"command": "echo ok > done.txt"}}],
}
FINISH: JsonDict = {"content": "", "tool_calls": [{"name": "finish", "arguments": {"summary": "all set"}}]}
CHECK = CheckSpec(command='test "$(cat done.txt)" = ok; s=$?; echo "checks: $((1 - s))/1"; exit $s')


@pytest_asyncio.fixture
async def stack(tmp_path: Path) -> AsyncIterator[AgentStack]:
    opened = AgentStack(replace(AgentsConfig.embedded(tmp_path / "agents"), lease_s=2))
    yield opened
    await opened.close()


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[SandboxPool]:
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=2)) as running:
        yield running


async def run(stack: AgentStack, pool: SandboxPool, spec: TaskSpec, replies: list[JsonDict]) -> str:
    task_id = await stack.submit(spec)
    model = ScriptedClient(replies)
    runner = TaskRunner(stack.journal, stack.artifacts, pool, model, "w", RunnerConfig(lease_s=2))
    await runner.run(task_id)
    return task_id


async def test_a_finished_task_whose_check_passes_succeeds_with_the_outcome_journaled(
    stack: AgentStack, pool: SandboxPool
) -> None:
    task_id = await run(stack, pool, TaskSpec(goal="write done.txt", check=CHECK), [WRITE_DONE, FINISH])
    task = stack.journal.get_task(task_id)
    assert task.status is TaskStatus.SUCCEEDED
    outcome = CheckOutcome.find(task.result)
    assert outcome is not None and outcome.passed and outcome.exit_code == 0 and outcome.fraction == 1.0
    assert task.result is not None and task.result.startswith("all set\ncheck: ")


async def test_a_finished_task_whose_check_fails_has_failed(stack: AgentStack, pool: SandboxPool) -> None:
    task_id = await run(stack, pool, TaskSpec(goal="write done.txt", check=CHECK), [FINISH])
    task = stack.journal.get_task(task_id)
    assert task.status is TaskStatus.FAILED
    assert task.error is not None and task.error.startswith("the success check failed (exit status 1)")
    outcome = CheckOutcome.find(task.error)
    assert outcome is not None and not outcome.passed and outcome.fraction == 0.0


async def test_a_task_out_of_budget_still_runs_its_check(stack: AgentStack, pool: SandboxPool) -> None:
    spec = TaskSpec(goal="write done.txt", check=CHECK, limits=Limits(max_steps=1), require_finish=True)
    task_id = await run(stack, pool, spec, [WRITE_DONE, FINISH])
    task = stack.journal.get_task(task_id)
    assert task.status is TaskStatus.FAILED and task.error is not None
    outcome = CheckOutcome.find(task.error)
    assert outcome is not None and outcome.passed  # the work was done; the budget ended the task


async def test_a_task_without_a_check_journals_no_outcome(stack: AgentStack, pool: SandboxPool) -> None:
    task_id = await run(stack, pool, TaskSpec(goal="finish"), [FINISH])
    task = stack.journal.get_task(task_id)
    assert task.status is TaskStatus.SUCCEEDED and task.result == "all set"


@pytest.mark.parametrize(
    ("stdout", "fraction"),
    [("checks: 3/4\n", 0.75), ("x\nchecks: 0/2", 0.0), ("checks: 1/0", None), ("no tally", None), ("", None)],
)
def test_a_tally_line_gives_partial_credit(stdout: str, fraction: float | None) -> None:
    assert tally(stdout) == fraction


def test_an_outcome_reads_back_from_the_text_it_was_journaled_in() -> None:
    outcome = CheckOutcome(passed=False, exit_code=2, fraction=0.5, output="failed: x")
    assert CheckOutcome.find(with_outcome("budget spent", outcome)) == outcome
    assert CheckOutcome.find(with_outcome(None, outcome)) == outcome
    assert CheckOutcome.find("no check here") is None and CheckOutcome.find(None) is None


@pytest.mark.parametrize(
    ("check", "field"),
    [
        ({"command": ""}, "check.command"),
        ({"command": "true", "timeout_s": 0}, "check.timeout_s"),
        ({"command": "true", "retries": 2}, "check.retries"),
        (
            {"timeout_s": 5},
            "check = {'timeout_s': 5}: Value error, a check needs a `command`, a `suite` or both",
        ),
        ({"suite": {"imports": "import m"}}, "check.suite.tests"),
        ({"suite": {"imports": "", "tests": "def test_a(m): pass"}}, "check.suite.imports"),
    ],
)
def test_a_bad_check_is_refused_naming_the_field(check: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build_task_spec({"goal": "g", "check": check}, "task.yaml")


async def test_a_task_that_crashed_before_its_check_runs_it_on_resume_against_its_final_workdir(
    stack: AgentStack, pool: SandboxPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    async def crash_once(*args: Any) -> CheckOutcome:
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("worker died before the check")
        return await run_check(*args)

    monkeypatch.setattr("tether.agents.runner.run_check", crash_once)
    spec = TaskSpec(goal="write done.txt", check=CHECK)
    with pytest.raises(RuntimeError, match="worker died"):
        await run(stack, pool, spec, [WRITE_DONE, FINISH])
    (task,) = stack.journal.list_tasks()
    assert task.status is TaskStatus.RUNNING
    model = ScriptedClient([])  # the steps are journaled: the resumed task never asks the model
    runner = TaskRunner(stack.journal, stack.artifacts, pool, model, "w", RunnerConfig(lease_s=2))
    assert await runner.run(task.task_id) is TaskStatus.SUCCEEDED
    outcome = CheckOutcome.find(stack.journal.get_task(task.task_id).result)
    assert outcome is not None and outcome.passed and len(calls) == 2


def test_the_task_line_names_the_check_outcome_in_words() -> None:
    outcome = CheckOutcome(passed=False, exit_code=1, fraction=0.25, output="")
    task = TaskRecord("t-1", {}, TaskStatus.FAILED, 0.0, 0.0, error=with_outcome("budget spent", outcome))
    assert task_line(task) == (
        "task t-1 failed: budget spent; success check failed (exit status 1, 25% of its checks)"
    )
    assert without_outcome(task.error) == "budget spent"


async def test_a_suite_check_counts_each_hidden_test_with_the_command_s_checks(pool: SandboxPool) -> None:
    suite = SuiteCheck(
        imports="import calc",
        tests=(
            "def test_adds(m):\n    assert m.calc.add(2, 3) == 5\n\n"
            "def test_subtracts(m):\n    assert m.calc.sub(3, 2) == 1\n"
        ),
    )
    check = CheckSpec(command=CHECK.command, suite=suite)
    async with await pool.open_session() as session:
        await session.upload({"calc.py": "def add(a, b):\n    return a + b\n", "done.txt": "ok\n"})
        outcome = await run_check(session, TaskSpec(goal="g"), check)
        assert not outcome.passed and outcome.fraction == 2 / 3 and "failed: test_subtracts" in outcome.output
        await session.upload(
            {"calc.py": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"}
        )
        outcome = await run_check(session, TaskSpec(goal="g"), check)
        assert outcome.passed and outcome.fraction == 1.0 and outcome.exit_code == 0
        outcome = await run_check(
            session, TaskSpec(goal="g"), CheckSpec(suite=suite.model_copy(update={"imports": "import nope"}))
        )
        assert not outcome.passed and outcome.fraction == 0.0
