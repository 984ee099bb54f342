"""The token-budgeted context: within the budget at every step, a stable prefix between folds, the
digest bounded, the same plan after a resume, and budgets that cannot work refused with the reason."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.agents.test_replay import call, step
from tether.agents.context import DIGEST_TITLE, ContextPlan, folded_count
from tether.agents.context_budget import (
    ContextBudgetError,
    ContextFitter,
    FittedContext,
    elided_steps,
    planned_fold,
    step_budget,
)
from tether.agents.runner import RunnerConfig, TaskRunner
from tether.agents.service import AgentsConfig, AgentStack
from tether.agents.task import ContextSpec, Limits, RoleSpec, TaskSpec
from tether.chat import ChatRequest
from tether.chat.tokens import estimate_prompt_tokens
from tether.errors import ConfigError
from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec
from tether.store.records import StepRecord, TaskStatus
from tether.testing.scripted import ScriptedClient
from tether.tools import BUILTIN_TOOLS

TOOLS = BUILTIN_TOOLS.only(("shell", "read_file", "finish")).specs()
BUDGET = 3000


def long_task(count: int) -> list[StepRecord]:
    """Steps whose observations vary from a line to a page, as reading files and running tests do."""
    sizes = itertools.cycle([40, 900, 150, 1800, 60, 400])
    return [
        step(n, (call(n, 0, observation={"content": f"out{n} " + "x" * next(sizes), "error": False}),))
        for n in range(count)
    ]


def spec_with(budget: int = BUDGET, **context: object) -> TaskSpec:
    return TaskSpec(
        goal="survey the repository",
        context=ContextSpec(budget_tokens=budget, recent_steps=4, recall_k=3, **context),
    )


@functools.cache  # three tests read the same long run
def long_run() -> list[FittedContext]:
    return fit_all(spec_with(), long_task(240))


def fit_all(spec: TaskSpec, steps: list[StepRecord]) -> list[FittedContext]:
    fitter = ContextFitter(estimate_prompt_tokens)
    return [
        fitter.fit(spec, spec.roles[0], steps[:n], [f"recalled for step {n}"] * 3, TOOLS, BUDGET)
        for n in range(len(steps) + 1)
    ]


def test_the_prompt_never_exceeds_the_budget_over_a_long_task() -> None:
    fitted = long_run()
    for context in fitted:
        counted = estimate_prompt_tokens(ChatRequest(context.messages, tools=TOOLS))
        assert counted == context.prompt_tokens <= BUDGET
    assert fitted[-1].plan.folded > folded_count(240, 4) - 50  # it does fold: the tail is short
    assert max(c.prompt_tokens for c in fitted) > BUDGET * 0.7  # and uses the budget it has


def test_consecutive_prompts_share_their_prefix_except_at_fold_points() -> None:
    fitted = long_run()
    folds = 0
    for before, after in itertools.pairwise(fitted[1:]):
        stable = before.messages[:-1]  # the recalled observations come last and change every step
        if before.plan == after.plan:
            assert after.messages[: len(stable)] == stable
        else:
            folds += 1
            assert after.plan.folded > before.plan.folded  # folds only move forward
            assert after.messages[:2] == before.messages[:2]  # system prompt and task header
    assert 0 < folds <= 240 // 4  # at most one fold per block of steps


def test_the_digest_stays_within_its_share_by_leaving_out_its_oldest_blocks() -> None:
    fitted = long_run()
    last = fitted[-1]
    assert last.plan.elided > 0 and last.plan.elided % 4 == 0
    (digest,) = [m["content"] for m in last.messages if DIGEST_TITLE in str(m["content"])]
    assert digest.startswith(f"Steps before step {last.plan.elided} are left out")
    assert estimate_prompt_tokens(ChatRequest([{"role": "user", "content": digest}])) <= BUDGET * 0.3 + 100
    elisions = len({c.plan.elided for c in fitted})
    assert elisions < len({c.plan.folded for c in fitted})  # its start changes less often than its end


def test_a_fresh_fitter_rebuilds_the_same_context_from_the_journal() -> None:
    spec, steps = spec_with(), long_task(120)
    first = ContextFitter(estimate_prompt_tokens)
    for n in range(121):  # a runner that has seen every step, as the one that ran it
        seen = first.fit(spec, spec.roles[0], steps[:n], [], TOOLS, BUDGET)
    resumed = ContextFitter(estimate_prompt_tokens).fit(spec, spec.roles[0], steps, [], TOOLS, BUDGET)
    assert resumed == seen


def test_a_generous_budget_folds_by_count_as_before() -> None:
    spec = TaskSpec(goal="g", context=ContextSpec(recent_steps=4, budget_tokens=1_000_000))
    steps = long_task(30)
    for n in range(31):
        fitted = ContextFitter(estimate_prompt_tokens).fit(spec, spec.roles[0], steps[:n], [], TOOLS, 10**6)
        assert fitted.plan == ContextPlan(folded_count(n, 4))


@pytest.mark.parametrize(
    ("step_tokens", "room", "folded"),
    [
        ([10] * 6, 100, 0),  # all fits: nothing folds before the count rule would
        ([10] * 12, 1000, 8),  # the count rule alone (block 4: 12 steps -> 8 folded)
        ([100] * 7, 350, 4),  # 400 outgrows 350 at the 4th step: the first block folds
        ([300, 10, 10, 10, 300, 300, 10], 400, 4),  # no boundary leaves half the room: the last one
    ],
)
def test_the_tail_folds_back_to_half_its_room(step_tokens: list[int], room: int, folded: int) -> None:
    summed = [0, *itertools.accumulate(step_tokens)]
    assert planned_fold(summed, 4, room) == folded


def test_elision_keeps_the_newest_block_when_nothing_smaller_fits() -> None:
    summed = [0, *itertools.accumulate([100] * 8)]
    assert elided_steps(summed, 8, 4, 250) == 4  # 800 > 250: drop the oldest block, keep the newest
    assert elided_steps(summed, 8, 4, 10_000) == 0


@pytest.mark.parametrize(
    ("context", "message"),
    [
        ({"budget_tokens": 10}, "budget_tokens"),
        ({"budget_tokens": 0}, "budget_tokens"),
        ({"digest_share": 1.5}, "digest_share"),
        ({"digest_share": 0}, "digest_share"),
    ],
)
def test_bad_context_settings_are_refused(context: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ContextSpec(**context)


def test_a_runner_cap_below_the_least_budget_is_refused() -> None:
    with pytest.raises(ConfigError, match="context_budget_tokens = 100: expected at least 256"):
        RunnerConfig(context_budget_tokens=100)


def test_the_budget_is_capped_by_the_runner_and_the_model_window() -> None:
    spec = TaskSpec(goal="g", limits=Limits(max_output_tokens=500), context=ContextSpec(budget_tokens=8000))
    assert step_budget(spec, None, None) == 8000
    assert step_budget(spec, 3000, None) == 3000
    assert step_budget(spec, None, 4096) == 3596  # the model's window less the reply
    with pytest.raises(ContextBudgetError, match="leaves 100 for the prompt"):
        step_budget(spec, None, 600)


def test_a_budget_that_cannot_hold_the_fixed_prompt_is_refused_with_both_numbers() -> None:
    spec = TaskSpec(
        goal="g",
        roles=(RoleSpec(name="agent", system_prompt="p" * 3000),),
        context=ContextSpec(budget_tokens=512),
    )
    with pytest.raises(ContextBudgetError, match=r"512 tokens cannot hold step 3's prompt .* take \d+"):
        ContextFitter(estimate_prompt_tokens).fit(spec, spec.roles[0], long_task(3), [], TOOLS, 512)


async def test_a_task_whose_budget_cannot_hold_its_prompt_fails_with_the_reason(tmp_path: Path) -> None:
    stack = AgentStack(AgentsConfig.embedded(tmp_path / "agents"))
    spec = TaskSpec(
        goal="g",
        roles=(RoleSpec(name="agent", system_prompt="p" * 3000),),
        context=ContextSpec(budget_tokens=512),
    )
    task_id = await stack.submit(spec)
    try:
        async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1)) as pool:
            runner = TaskRunner(stack.journal, stack.artifacts, pool, ScriptedClient([]), "w")
            assert await runner.run(task_id) is TaskStatus.FAILED
        task, steps = stack.journal.get_task(task_id), stack.journal.steps(task_id)
    finally:
        await stack.close()
    assert task.error is not None and "512 tokens cannot hold step 0's prompt" in task.error
    assert steps == []  # refused before any model call
