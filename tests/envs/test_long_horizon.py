"""Long-horizon repository task: the reference trajectory passes every hidden test; partial work earns
partial credit; touching the tests or subverting the test run earns nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tether.chat import Messages
from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.episode import run_episode, scripted_policy
from tether.envs.errors import EnvError
from tether.envs.long_horizon import TASKS, long_env
from tether.envs.shell import tool_call_message
from tether.sandbox import PoolConfig, SandboxSpec

module_loop = pytest.mark.asyncio(loop_scope="module")  # the loop that holds the module's pool


# One pool for the module: starting one costs about 0.4 s, more than most tests here.
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ctx() -> AsyncIterator[ScoringContext]:
    async with SandboxProvider(SandboxSpec(timeout_s=10, memory_mib=256), PoolConfig(slots=2)) as sandbox:
        yield ScoringContext(sandbox)


def write(path: str, source: str, index: int) -> dict[str, object]:
    return tool_call_message("python", {"code": f"open({path!r}, 'w').write({source!r})\n"}, index)


def submit() -> dict[str, object]:
    return tool_call_message("submit", {"answer": "done"}, 99)


@pytest.mark.parametrize("name", list(TASKS))
def test_repositories_follow_the_seed_and_hide_the_hidden_tests(name: str) -> None:
    env = long_env(name)
    task = env.task(0)
    assert task == env.task(0)
    assert task.data["files"]["README.md"] != env.task(1).data["files"]["README.md"] or (
        task.data["hidden_tests"] != env.task(1).data["hidden_tests"]
    )
    assert "def test_" not in task.messages[1]["content"]
    assert len(env.reference(task)) >= 6  # many tool calls


def test_unknown_task_is_a_clear_error() -> None:
    with pytest.raises(EnvError, match="'compiler'"):
        long_env("compiler")


@module_loop
@pytest.mark.parametrize("name", list(TASKS))
async def test_reference_trajectory_passes_visible_and_hidden_tests(name: str, ctx: ScoringContext) -> None:
    env = long_env(name)
    for seed in (0, 1):
        task = env.task(seed)
        result = await run_episode(env, task, scripted_policy(env.reference(task)), ctx.child())
        assert result.score.total == 1.0, result.score
        unittest_output = result.messages[-3]["content"]
        assert "OK" in unittest_output and "FAILED" not in unittest_output, unittest_output


@module_loop
@pytest.mark.parametrize("name", list(TASKS))
async def test_one_module_of_three_earns_partial_credit(name: str, ctx: ScoringContext) -> None:
    env = long_env(name)
    task = env.task(2)
    path, source = next(iter(task.data["modules"].items()))
    result = await run_episode(env, task, scripted_policy([write(path, source, 0), submit()]), ctx.child())
    assert 0.1 < result.score.components["checks"] < 0.9
    assert result.score.total == 0.0


@module_loop
@pytest.mark.parametrize("name", list(TASKS))
async def test_editing_the_tests_is_a_violation(name: str, ctx: ScoringContext) -> None:
    env = long_env(name)
    task = env.task(0)
    test_file = task.data["protected"][-1]
    gut = f"printf 'import unittest\\n' > {test_file}"
    replies = [tool_call_message("shell", {"command": gut}, 0), *env.reference(task)]
    result = await run_episode(env, task, scripted_policy(replies), ctx.child())
    assert result.score.qc_violation == f"protected file {test_file} changed"
    assert result.score.total == 0.0
    assert result.turns == 1


ANYTHING = (
    "class Any:\n    def __eq__(self, other):\n        return True\n\n\n"
    "def __getattr__(name):\n    return lambda *args, **kwargs: Any()\n"
)


@module_loop
@pytest.mark.parametrize("name", list(TASKS))
@pytest.mark.parametrize(
    "package",
    [
        "import os\nos._exit(0)\n",  # ends the process that imports it
        "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n",  # blinds unittest
        "import builtins\nbuiltins.AssertionError = type('Never', (Exception,), {})\n",
        "import sys\nsys.modules['json'] = None\n",
    ],
)
async def test_a_package_that_subverts_its_tests_scores_zero(
    name: str, package: str, ctx: ScoringContext
) -> None:
    env = long_env(name)
    task = env.task(1)
    replies: Messages = [write(f"{name}/__init__.py", package, 0)]
    replies += [write(path, ANYTHING, i + 1) for i, path in enumerate(task.data["modules"])]
    result = await run_episode(env, task, scripted_policy([*replies, submit()]), ctx.child())
    assert result.score.total == 0.0
    assert result.score.components["checks"] <= 0.2  # only reject-bad-input tests can pass by luck
