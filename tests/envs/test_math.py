"""math/*: equivalent forms are accepted, hedges and restatements are not."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tether.envs.math import GENERATORS, MAX_ANSWER_CHARS, equivalent, math_environment, tame


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
