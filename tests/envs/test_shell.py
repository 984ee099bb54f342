"""Shell environments: reference trajectories solve the task; claims, shortcuts and tampering score 0."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tether.chat import Message
from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.episode import run_episode, scripted_policy
from tether.envs.errors import EnvError
from tether.envs.shell import TASKS, ShellSource, ShellTask, shell_env, tool_call_message
from tether.sandbox import PoolConfig, SandboxSpec

module_loop = pytest.mark.asyncio(loop_scope="module")  # the loop that holds the module's pool


# One pool for the module: starting one costs about 0.4 s, more than most tests here.
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ctx() -> AsyncIterator[ScoringContext]:
    async with SandboxProvider(SandboxSpec(timeout_s=10, memory_mib=256), PoolConfig(slots=2)) as sandbox:
        yield ScoringContext(sandbox)


def shell(command: str, index: int = 0) -> Message:
    return tool_call_message("shell", {"command": command}, index)


def submit(index: int = 9) -> Message:
    return tool_call_message("submit", {"answer": "done"}, index)


def test_tasks_are_seeded_and_hide_the_expected_state() -> None:
    for name in TASKS:
        env = shell_env(name)
        task = env.task(3)
        assert task == env.task(3)
        assert task.data["files"] != env.task(4).data["files"]
        assert [tool["function"]["name"] for tool in task.tools] == ["shell", "python", "submit"]
        assert "sha" not in task.messages[1]["content"]


def test_a_replace_draw_with_nothing_to_edit_is_redrawn_and_other_draws_are_kept() -> None:
    # Seed 93105 once drew no `.txt` file under docs/, so the untouched tree passed and doing nothing
    # scored 1.0 (seeds 31 and 131 too).
    def raw(seed: int) -> ShellTask:
        return TASKS["replace"][0](random.Random(f"shell/replace:{seed}"))

    for seed in (31, 131, 93105):
        assert raw(seed).solved_untouched()
        task = ShellSource("replace").build(seed)
        assert not task.solved_untouched()
        assert any(path.startswith("docs/") and path.endswith(".txt") for path in task.files)
    assert all(ShellSource("replace").build(seed) == raw(seed) for seed in range(31))


def test_unknown_task_is_a_clear_error() -> None:
    with pytest.raises(EnvError, match="'defrag'"):
        shell_env("defrag")


@pytest.mark.parametrize("name", list(TASKS))
@module_loop
async def test_reference_trajectory_scores_one_and_claims_score_zero(name: str, ctx: ScoringContext) -> None:
    env = shell_env(name)
    task = env.task(0)
    result = await run_episode(env, task, scripted_policy(env.reference(task)), ctx.child())
    assert result.score.total == 1.0, result.score
    for claim in env.wrong_answers(task):
        wrong = await run_episode(
            env, task, scripted_policy([{"role": "assistant", "content": claim}]), ctx.child()
        )
        assert wrong.score.total == 0.0 and wrong.score.components["checks"] < 1.0


@module_loop
async def test_a_partial_solution_earns_checks_but_no_total(ctx: ScoringContext) -> None:
    env = shell_env("organize")
    task = env.task(1)
    first = next(path for path in sorted(task.data["files"]) if path.startswith("inbox/"))
    name = first.split("/", 1)[1]
    ext = name.rsplit(".", 1)[1] if "." in name else "none"
    replies = [shell(f"mkdir -p sorted/{ext} && mv {first} sorted/{ext}/"), submit()]
    result = await run_episode(env, task, scripted_policy(replies), ctx.child())
    assert 0.0 < result.score.components["checks"] < 1.0
    assert result.score.total == 0.0


@module_loop
async def test_editing_a_protected_file_ends_the_episode_with_a_violation(ctx: ScoringContext) -> None:
    env = shell_env("fixscript")
    task = env.task(2)
    replies = [shell("cp tests/example.txt /tmp/x && echo >> tests/expected.txt"), *env.reference(task)]
    result = await run_episode(env, task, scripted_policy(replies), ctx.child())
    assert result.score.total == 0.0
    assert result.score.qc_violation == "protected file tests/expected.txt changed"
    assert result.turns == 1  # the episode stopped at the violating step


@pytest.mark.parametrize(
    "command",
    ["rm TASK.md", "mv TASK.md t && cp t TASK.md && rm t && ln -sf t2 TASK.md", "chmod 000 TASK.md"],
)
@module_loop
async def test_removing_or_replacing_a_protected_file_is_a_violation(
    command: str, ctx: ScoringContext
) -> None:
    env = shell_env("report")
    task = env.task(0)
    result = await run_episode(env, task, scripted_policy([shell(command), submit()]), ctx.child())
    assert result.score.qc_violation is not None and "TASK.md" in result.score.qc_violation
    assert result.score.total == 0.0


@module_loop
async def test_a_script_that_prints_the_example_answer_fails_the_hidden_runs(ctx: ScoringContext) -> None:
    env = shell_env("fixscript")
    task = env.task(0)
    cheat = "printf '#!/bin/bash\\ncat tests/expected.txt\\n' > scripts/topwords.sh && bash tests/check.sh"
    result = await run_episode(env, task, scripted_policy([shell(cheat), submit()]), ctx.child())
    assert result.messages[3]["content"].rstrip().endswith("PASS")  # the visible check is fooled
    assert result.score.total == 0.0
    assert result.score.qc_violation is None


@module_loop
async def test_planted_modules_do_not_reach_the_grader(ctx: ScoringContext) -> None:
    env = shell_env("largefiles")
    task = env.task(0)
    plant = "printf 'def sha256(b=b\"\"):\\n    raise SystemExit(0)\\n' > hashlib.py; echo 'x' > stat.py"
    replies = [shell(plant, 0), *env.reference(task)]
    result = await run_episode(env, task, scripted_policy(replies), ctx.child())
    assert result.score.total == 1.0  # the real hashlib and stat graded the real state
