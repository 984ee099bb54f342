"""`bench/integer_arithmetic`: the seeded task, its final-integer reward, and the environment scoring it."""

from __future__ import annotations

import asyncio

import pytest

from tether.envs.bench import BENCH_ENV, IntegerArithmetic, final_integer, reward
from tether.envs.registry import default_registry


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 42.", 42),
        ("47 - 50 = -3", -3),
        ("First 12, then 7", 7),
        ("no digits here", None),
        ("", None),
    ],
)
def test_final_integer_is_the_last_integer_written(text: str, expected: int | None) -> None:
    assert final_integer(text) == expected


def test_reward_is_one_only_for_the_right_final_integer() -> None:
    assert reward("3 + 4 = 7", "7") == 1.0
    assert reward("7, or maybe 8", "7") == 0.0
    assert reward("I cannot say", "7") == 0.0


def test_tasks_are_seeded_integer_problems_that_the_environment_scores() -> None:
    source = IntegerArithmetic()
    assert source.problem(5) == source.problem(5)
    problems = [source.problem(seed) for seed in range(50)]
    assert len({p.prompt for p in problems}) > 40
    for problem in problems:
        a, op, b = problem.prompt.removeprefix("What is ").removesuffix("?").split()
        assert int(problem.answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    env = default_registry().get(BENCH_ENV)
    task = env.task(3)
    assert asyncio.run(env.score(task, f"So it is {task.reference}")).total == 1.0
    assert asyncio.run(env.score(task, "So it is 100000")).total == 0.0
