"""The gatekeepers in front of checkers that eval: ordinary answers pass, code and bombs do not."""

from __future__ import annotations

import pytest

from tether.envs.safe_expr import MAX_CHARS, is_arithmetic, is_literal

ATTACKS = [
    "__import__('os').system('touch /tmp/pwned')",
    "().__class__.__bases__[0].__subclasses__()",
    "open('/etc/passwd').read()",
    "exec('1')",
    "eval('1')",
    "input()",
    "breakpoint()",
    "x.real",
    "(1, 2)[0]",
    "lambda: 1",
    "[c for c in 'ab']",
    "{1: 2}",
    "'a' * 10",
    "S('x')",
    "N(x, n=10)",
    "x if x else 1",
    "x == 1",
    "a and b",
    "f'{x}'",
]


@pytest.mark.parametrize(
    "text", ["1", "-2.5", "'abc'", "[1, 2, [3, -4]]", "('a', 'b')", "[True, None]", "[]"]
)
def test_literals_pass(text: str) -> None:
    assert is_literal(text)


@pytest.mark.parametrize(
    "text", [*ATTACKS, "x", "1 + 2", "[x]", "{1, 2}", "", "[1, 2", "[" * 500 + "]" * 500]
)
def test_anything_but_a_literal_is_refused_by_is_literal(text: str) -> None:
    assert not is_literal(text)


@pytest.mark.parametrize(
    "text",
    [
        "-4*(-2*x - 8)**(3/2)/3 + C",
        "-34*x**8/15 - 5*x/4 + C",
        "2240*x**3 + 3584*x**2 - 896*x",
        "94*4 - 61 - 6",
        "10*(8 - 5) - 6",
        "exp(2*x)/2 + sin(x)**2 + sqrt(x) + log(Abs(x)) + pi",
        "x**(n + 1)/(n + 1)",
        "(2**100)**2",
    ],
)
def test_ordinary_math_answers_pass(text: str) -> None:
    assert is_arithmetic(text)


@pytest.mark.parametrize(
    "text",
    [
        *ATTACKS,
        "9**9**9",
        "2**(10**10)",
        "2**1000",
        "2**(-1000)",
        "2**(99*99*99)",
        "2**(x*0 + 99*99*99)",
        "2**(1/0.000001)",
        "2**(exp(1000))",
        "((2**99)**99)**99",
        "x // 2",
        "x % 2",
        "x @ y",
        "xy + 1",
        "é + 1",
        "1" * (MAX_CHARS + 1),
    ],
)
def test_code_and_arithmetic_bombs_are_refused(text: str) -> None:
    assert not is_arithmetic(text)
