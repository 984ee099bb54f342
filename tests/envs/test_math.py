"""math/*: equivalent forms are accepted, hedges and restatements are not."""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.math import (
    GENERATORS,
    MAX_ANSWER_CHARS,
    PROGRAM_PARSER,
    equivalent,
    last_printed_integer,
    math_environment,
    program_arithmetic_environment,
    tame,
)
from tether.sandbox.pool import PoolConfig


@pytest.mark.parametrize(
    "answer", ["1/2", "0.5", "\\frac{1}{2}", "\\dfrac12", "2^{-1}", "0.50", "$1/2$", "x = 1/2"]
)
def test_equivalent_forms_of_one_half_match(answer: str) -> None:
    assert equivalent("1/2", answer)


@pytest.mark.parametrize(
    "answer",
    [
        "1/3",
        "-1/2",
        "",
        "   ",
        "3 or 1/2",
        "1/2, 3",
        "3 = 1/2",
        "1/2 \\text{ or } 3",
        "\\boxed{3} \\boxed{1/2}",
        "The answer is 1/2",
        "} 3 \\boxed{1/2",
        "1/2" + " " * MAX_ANSWER_CHARS,
    ],
)
def test_wrong_and_hedged_answers_do_not_match(answer: str) -> None:
    assert not equivalent("1/2", answer)


@pytest.mark.parametrize(
    ("answer", "ok"),
    [("2, -3", True), ("-3,2", True), ("x=2, x=-3", True), ("2", False), ("2, -3, 5", False)],
)
def test_root_sets_compare_as_sets(answer: str, ok: bool) -> None:
    assert equivalent("-3, 2", answer) is ok


@pytest.mark.parametrize(
    ("answer", "ok"),
    [
        ("x = 1, y = 2", True),
        ("y = 2, x = 1", True),
        ("x = 2/2, y = 4/2", True),
        ("x = 2, y = 1", False),
        ("1, 2", False),
        ("2, 1", False),
        ("x = 1", False),
        ("x = 1, x = 1, y = 2", False),
        ("x = 1, y = 2, z = 3", False),
    ],
)
def test_systems_compare_assignments(answer: str, ok: bool) -> None:
    assert equivalent("x = 1, y = 2", answer) is ok


async def test_expansion_must_not_restate_the_product() -> None:
    env = math_environment("expand")
    task = env.task(0)
    factored = task.messages[1]["content"].split("Expand ")[1].split(" into")[0]
    assert (await env.score(task, f"<answer>{factored}</answer>")).total == 0.0
    assert (await env.score(task, f"<answer>{task.reference}</answer>")).total == 1.0


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generators_are_deterministic_and_vary_with_the_seed(name: str) -> None:
    generate = GENERATORS[name]
    assert generate(random.Random(5)) == generate(random.Random(5))
    assert len({generate(random.Random(seed))[0] for seed in range(10)}) >= 8


@pytest.mark.parametrize(
    "template",
    [
        "__import__('pathlib').Path('{marker}').write_text('x')",
        "\\text{{__import__('pathlib').Path('{marker}').write_text('x')}}",
        "x = __import__('pathlib').Path('{marker}').write_text('x')",
    ],
)
def test_answers_are_parsed_not_executed(template: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    assert not equivalent("1/2", template.format(marker=marker))
    assert not marker.exists()


@pytest.mark.parametrize(
    "answer",
    [
        "9^{9^{9^{9}}}",
        "9^(9^9)",
        "10^{10^{10}}",
        "2^{1000000}",
        "10^-100000000",
        "99999999999^{99999999}",
        "(10^{10})!",
        "100000!",
        "1" * 30,
    ],
)
def test_numbers_too_big_to_compute_are_refused_at_once(answer: str) -> None:
    import time

    start = time.monotonic()
    assert not equivalent("1/2", answer)
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("answer", ["x^{2}+y^{2}", "x^2+2x+1", "2^{-1}", "7^{16}", "(x+1)^{3}", "e^{\\pi}"])
def test_ordinary_powers_are_tame(answer: str) -> None:
    assert tame(answer)


# --- math/python_arithmetic: the answer is a program, run in the sandbox --------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node: ast.expr) -> int:
    """Python's own reading of the expression (precedence included), without executing anything."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    assert isinstance(node, ast.BinOp), ast.dump(node)
    return int(_OPS[type(node.op)](_value(node.left), _value(node.right)))


@pytest.mark.parametrize("seed", range(200))
def test_program_tasks_hold_the_value_python_computes(seed: int) -> None:
    task = program_arithmetic_environment().task(seed)
    expression = task.reference.removeprefix("print(").removesuffix(")\n")
    assert f"What is {expression}?" in task.messages[1]["content"]
    assert task.data["value"] == _value(ast.parse(expression, mode="eval").body)


@pytest.mark.parametrize(
    ("stdout", "value"),
    [("57\n", 57), ("The result is -12.\n", -12), ("3 + 4 = 7\n", 7), ("", None), ("none\n", None)],
)
def test_only_the_last_printed_integer_counts(stdout: str, value: int | None) -> None:
    assert last_printed_integer(stdout) == value


module_loop = pytest.mark.asyncio(loop_scope="module")  # the loop that holds the module's pool


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ctx() -> AsyncIterator[ScoringContext]:
    async with SandboxProvider(config=PoolConfig(slots=2)) as sandbox:
        yield ScoringContext(sandbox)


@module_loop
@pytest.mark.parametrize(
    ("program", "reward"),
    [
        ("print({value})", 1.0),
        ("x = {value}\nprint(f'The result is {{x}}')", 1.0),
        ("print({value} + 1)", 0.0),
        ("print({value})\nprint(0)", 0.0),
        ("print({value})\nraise SystemExit(3)", 0.0),
        ("import sys\nprint({value}, file=sys.stderr)", 0.0),
        ("result = {value}", 0.0),
    ],
)
async def test_program_answers_score_by_what_the_sandbox_run_prints(
    program: str, reward: float, ctx: ScoringContext
) -> None:
    env = program_arithmetic_environment()
    task = env.task(3)
    completion = PROGRAM_PARSER.format(program.format(value=task.data["value"]))
    score = await env.score(task, completion, ctx.child())
    assert score.components["correctness"] == reward
    assert score.passed is (reward == 1.0)
    assert score.sandbox_time_s > 0


@module_loop
async def test_a_program_that_loops_is_stopped_and_scores_zero(ctx: ScoringContext) -> None:
    env = program_arithmetic_environment()
    task = env.task(0)
    score = await env.score(task, PROGRAM_PARSER.format("while True:\n    pass"), ctx.child())
    assert score.total == 0.0 and "timeout" in score.detail["run"]


@module_loop
async def test_an_answer_without_a_program_is_not_run(ctx: ScoringContext) -> None:
    env = program_arithmetic_environment()
    task = env.task(0)
    child = ctx.child()
    score = await env.score(task, f"The answer is {task.data['value']}.", child)
    assert score.total == 0.0 and child.sandbox_time_s == 0.0
