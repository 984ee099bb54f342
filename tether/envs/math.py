"""Arithmetic and algebra generators (`math/<name>`), answers checked for equivalence with math-verify.

Each generator draws a problem from `Random(seed)` and computes its answer exactly (`Fraction`), so
`1/2`, `0.5` and `\\frac{1}{2}` all match a reference of `1/2`. The answer is parsed as one LaTeX
expression (as if boxed), never searched for in free text, so hedges such as `3 or 1/2`, `3 = 1/2`
or a list of candidates do not match; sets of roots and `x = ..., y = ...` assignments compare as sets.
`math/python_arithmetic` is the exception: the answer is a Python program, run in the sandbox (never in
this process), and the last integer it prints is compared with the exact value.
"""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from typing import Any

from math_verify import LatexExtractionConfig, parse, verify  # type: ignore[import-untyped,unused-ignore]

from tether.envs.code.extract import CodeBlockParser
from tether.envs.episode import Environment
from tether.envs.exploits import printed_literally
from tether.envs.parsers import ANSWER_TAG
from tether.envs.registry import EnvRegistry
from tether.envs.rubric import answer_rubric, hedged
from tether.envs.sandboxed import capped_spec
from tether.envs.scoring import RewardInput
from tether.envs.tasks import ChatRenderer, Problem, Task
from tether.sandbox.result import RunStatus

MAX_ANSWER_CHARS = 200  # longer "answers" are refused before sympy sees them (they can be slow to parse)
SYSTEM = (
    "You are solving a math problem. Give the exact answer as a number or a LaTeX expression "
    "(fractions such as 3/4 or \\frac{3}{4} are fine). " + ANSWER_TAG.instructions
)
_LATEX = [LatexExtractionConfig(boxed_match_priority=0)]


def fmt(value: Fraction | int) -> str:
    value = Fraction(value)
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _timeout() -> int | None:
    # math-verify times out with SIGALRM, which exists only on the main thread.
    return 5 if threading.current_thread() is threading.main_thread() else None


def _parse(text: str) -> list[Any]:
    return list(
        parse(
            f"\\boxed{{{text}}}",
            _LATEX,
            fallback_mode="no_fallback",
            extraction_mode="first_match",
            parsing_timeout=_timeout(),
        )
    )


def _is_hedge(expr: Any) -> bool:
    """`3 = 1/2`: math-verify compares an equation's right side, so a number on the left is a hedge."""
    items = expr if isinstance(expr, set | frozenset) else [expr]
    return any(
        getattr(item, "is_Relational", False) and not getattr(item.lhs, "is_Symbol", False) for item in items
    )


def _exponents(text: str) -> list[str]:
    """The exponent of every `^`: a braced or parenthesised group, or the one token that follows."""
    groups = []
    for start in (i for i, ch in enumerate(text) if ch == "^"):
        rest = text[start + 1 :].lstrip()
        if rest[:1] in ("{", "("):
            opener, closer = rest[0], "}" if rest[0] == "{" else ")"
            depth, end = 0, len(rest)  # unbalanced: the exponent runs to the end
            for index, ch in enumerate(rest):
                depth += (ch == opener) - (ch == closer)
                if depth == 0:
                    end = index
                    break
            groups.append(rest[1:end])
        else:
            token = re.match(r"-?\d+|\\[A-Za-z]+|.?", rest)
            groups.append(token.group() if token else "")
    return groups


def tame(text: str) -> bool:
    """No towers, huge exponents, factorials or giant numbers: sympy would compute them exactly (slowly)."""
    if "!" in text or re.search(r"\d{21,}", text):
        return False
    return all("^" not in group and not re.search(r"\d{4,}", group) for group in _exponents(text))


def _assignments(text: str) -> dict[str, str] | None:
    """`x = 1, y = 2` as {"x": "1", "y": "2"}; None unless every item assigns a new single letter."""
    values: dict[str, str] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not re.fullmatch(r"[a-z]", name) or name in values or not value.strip():
            return None
        values[name] = value.strip()
    return values


def equivalent(reference: str, answer: str) -> bool:
    """Whether `answer` is mathematically the reference (equal value, same set, same assignments)."""
    if not answer.strip() or len(answer) > MAX_ANSWER_CHARS or "\\boxed" in answer or not tame(answer):
        return False
    expected = _assignments(reference) if "=" in reference else None
    if expected is not None:
        # math-verify would compare the right-hand sides as a set, so `2, 1` would match `x = 1, y = 2`.
        given = _assignments(answer)
        return (
            given is not None
            and given.keys() == expected.keys()
            and all(equivalent(expected[name], given[name]) for name in expected)
        )
    gold, target = _parse(reference), _parse(answer)
    if not gold or not target or _is_hedge(target[0]):
        return False
    return bool(verify(gold, target, timeout_seconds=_timeout()))


# --- generators: each returns (question, reference answer, extra data) -----------------------------------

Generated = tuple[str, str, dict[str, Any]]


def _nonzero(rng: random.Random, low: int, high: int) -> int:
    return rng.choice([v for v in range(low, high + 1) if v != 0])


def arithmetic(rng: random.Random) -> Generated:
    """An integer expression of four operations with parentheses; division may leave a fraction."""
    a, b, c, d = (rng.randint(-30, 30) for _ in range(4))
    e = _nonzero(rng, -12, 12)
    op1, op2 = rng.choice("+-*"), rng.choice("+-*")
    expression = f"({a} {op1} {b}) {op2} {c} - {d} / {e}"
    first = {"+": a + b, "-": a - b, "*": a * b}[op1]
    value = {"+": first + c, "-": first - c, "*": first * c}[op2] - Fraction(d, e)
    return f"Compute {expression}.", fmt(value), {"expression": expression}


def fractions(rng: random.Random) -> Generated:
    x = Fraction(rng.randint(-20, 20), rng.randint(2, 15))
    y = Fraction(rng.randint(1, 20), rng.randint(2, 15))
    op = rng.choice("+-*/")
    value = {"+": x + y, "-": x - y, "*": x * y, "/": x / y}[op]
    text = f"({fmt(x)}) {op} ({fmt(y)})"
    return f"Compute {text} and simplify the result.", fmt(value), {}


def decimals(rng: random.Random) -> Generated:
    x, y = Fraction(rng.randint(-9999, 9999), 100), Fraction(rng.randint(1, 999), 10)
    op = rng.choice("+-*")
    value = {"+": x + y, "-": x - y, "*": x * y}[op]
    return f"Compute {float(x):.2f} {op} {float(y):.1f} exactly.", fmt(value), {}


def percent(rng: random.Random) -> Generated:
    if rng.random() < 0.5:
        p, n = rng.randint(1, 250), rng.randint(1, 2000)
        return f"What is {p}% of {n}?", fmt(Fraction(p * n, 100)), {}
    part, whole = rng.randint(1, 500), rng.randint(1, 500)
    return (
        f"{part} is what percent of {whole}? Answer with the number of percent.",
        fmt(Fraction(100 * part, whole)),
        {},
    )


def linear_equation(rng: random.Random) -> Generated:
    a, c = _nonzero(rng, -12, 12), rng.randint(-12, 12)
    while c == a:
        c = rng.randint(-12, 12)
    b, d = rng.randint(-50, 50), rng.randint(-50, 50)
    equation = f"{a}x + {b} = {c}x + {d}".replace("+ -", "- ")
    return f"Solve for x: {equation}.", fmt(Fraction(d - b, a - c)), {}


def quadratic(rng: random.Random) -> Generated:
    r1, r2, k = rng.randint(-15, 15), rng.randint(-15, 15), _nonzero(rng, -4, 4)
    b, c = -k * (r1 + r2), k * r1 * r2
    equation = f"{k}x^2 + {b}x + {c} = 0".replace("+ -", "- ")
    roots = sorted({r1, r2})
    question = f"Find all real solutions of {equation}. List them separated by commas."
    return question, ", ".join(str(r) for r in roots), {"roots": roots}


def linear_system(rng: random.Random) -> Generated:
    x, y = rng.randint(-20, 20), rng.randint(-20, 20)
    while True:
        a, b, c, d = (_nonzero(rng, -9, 9) for _ in range(4))
        if a * d - b * c != 0:
            break
    eq1 = f"{a}x + {b}y = {a * x + b * y}".replace("+ -", "- ")
    eq2 = f"{c}x + {d}y = {c * x + d * y}".replace("+ -", "- ")
    question = f"Solve the system {eq1} and {eq2}. Answer in the form x = ..., y = ..."
    return question, f"x = {x}, y = {y}", {}


def polynomial_value(rng: random.Random) -> Generated:
    coefficients = [rng.randint(-9, 9) for _ in range(rng.randint(3, 5))]
    point = rng.randint(-6, 6)
    terms = " + ".join(f"{c}x^{len(coefficients) - 1 - i}" for i, c in enumerate(coefficients))
    value = sum(c * point ** (len(coefficients) - 1 - i) for i, c in enumerate(coefficients))
    return f"Evaluate p(x) = {terms.replace('+ -', '- ')} at x = {point}.", str(value), {}


def powers(rng: random.Random) -> Generated:
    base, m, n, k = rng.randint(2, 7), rng.randint(-4, 6), rng.randint(-4, 6), rng.randint(-4, 6)
    value = Fraction(base) ** (m + n - k)
    return f"Compute {base}^{{{m}}} \\cdot {base}^{{{n}}} / {base}^{{{k}}} exactly.", fmt(value), {}


def expand(rng: random.Random) -> Generated:
    a, b, c, d = (_nonzero(rng, -9, 9) for _ in range(4))
    square, linear, constant = a * c, a * d + b * c, b * d
    question = f"Expand ({a}x + {b})({c}x + {d}) into a polynomial without parentheses.".replace("+ -", "- ")
    answer = f"{square}x^2 + {linear}x + {constant}".replace("+ -", "- ")
    return question, answer, {"expanded": True}


GENERATORS: dict[str, Callable[[random.Random], Generated]] = {
    "arithmetic": arithmetic,
    "fractions": fractions,
    "decimals": decimals,
    "percent": percent,
    "linear_equation": linear_equation,
    "quadratic": quadratic,
    "linear_system": linear_system,
    "polynomial_value": polynomial_value,
    "powers": powers,
    "expand": expand,
}


@dataclass(frozen=True, slots=True)
class MathSource:
    generator: Callable[[random.Random], Generated]

    def problem(self, seed: int) -> Problem:
        question, answer, data = self.generator(random.Random(seed))
        return Problem(prompt=question, answer=answer, data=data)


def correctness(inp: RewardInput) -> float:
    answer = inp.parsed.answer
    if answer is None:
        return 0.0
    if inp.task.data.get("expanded") and "(" in answer:  # an unexpanded product restates the question
        return 0.0
    return 1.0 if equivalent(inp.task.reference, answer) else 0.0


def _adversarial(task: Task) -> list[str]:
    wrong = f"{task.reference} + 1" if "," not in task.reference else f"{task.reference}, 1000"
    return [
        hedged(ANSWER_TAG, task.reference),
        ANSWER_TAG.format(f"1000 = {task.reference}")
        if "=" not in task.reference
        else ANSWER_TAG.format("7"),
        ANSWER_TAG.format(f"1000 \\text{{ or }} {task.reference}"),
        ANSWER_TAG.format(wrong),
        ANSWER_TAG.format(f"\\boxed{{1000}} \\boxed{{{task.reference}}}"),
    ]


def math_environment(name: str) -> Environment:
    return Environment(
        name=f"math/{name}",
        source=MathSource(GENERATORS[name]),
        renderer=ChatRenderer(SYSTEM),
        parser=ANSWER_TAG,
        rubric=answer_rubric(correctness, max_chars=4000),
        description=f"generated {name.replace('_', ' ')} problems, checked with math-verify",
        adversarial=_adversarial,
    )


# --- math/python_arithmetic: the model computes with a program, the sandbox runs it ---------------------

PROGRAM_PARSER = CodeBlockParser("python")
PROGRAM_SYSTEM = (
    "You solve arithmetic problems by writing a short Python program that prints the answer. "
    + PROGRAM_PARSER.instructions
)
PROGRAM_TIMEOUT_S = 2.0  # a looping answer costs this much sandbox time, not the pool default; print takes ms
PROGRAM_MAX_CHARS = 400  # full length reward up to here: `print(...)` of the expression is one line
_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True, slots=True)
class ProgramArithmeticSource:
    """`a op b op c` over + - * with two-digit operands (one digit next to a product): integer values.

    The reference answer is the program `print(<expression>)` (the form the code-block parser extracts);
    the value it prints is kept in `data["value"]`."""

    def problem(self, seed: int) -> Problem:
        rng = random.Random(seed)
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        a = rng.randint(2, 9 if op1 == "*" else 99)
        b = rng.randint(2, 9 if "*" in (op1, op2) else 99)
        c = rng.randint(2, 9 if op2 == "*" else 99)
        expression = f"{a} {op1} {b} {op2} {c}"
        first = {"+": a + b, "-": a - b, "*": a * b}
        # Python's precedence: a product binds tighter than the sum or difference before it.
        if op2 == "*" and op1 != "*":
            value = a + b * c if op1 == "+" else a - b * c
        else:
            value = {"+": first[op1] + c, "-": first[op1] - c, "*": first[op1] * c}[op2]
        question = f"What is {expression}? Write a Python program that prints the result."
        return Problem(prompt=question, answer=f"print({expression})\n", data={"value": value})


def last_printed_integer(stdout: str) -> int | None:
    """The last integer in a program's output (a leading minus counts): only one candidate ever counts."""
    found = _INTEGER.findall(stdout)
    return int(found[-1]) if found else None


async def program_correctness(inp: RewardInput) -> float:
    """1 when the program exits cleanly and the last integer it printed is the value."""
    program = inp.parsed.answer
    if program is None:
        return 0.0
    spec = await capped_spec(inp.ctx, PROGRAM_TIMEOUT_S)
    result = await inp.ctx.run(program, "python", spec=spec)
    if result.status is not RunStatus.OK:
        inp.detail["run"] = f"{result.status.value}: {(result.error or result.stderr)[-200:]}"
        return 0.0
    printed = last_printed_integer(result.stdout)
    inp.detail["printed"] = printed
    return 1.0 if printed == inp.task.data["value"] else 0.0


def _program_adversarial(task: Task) -> list[str]:
    value = int(task.data["value"])
    return [
        PROGRAM_PARSER.format(f"print({value + 1})"),
        PROGRAM_PARSER.format(f"print({value})\nprint({value + 1})"),  # only the last integer counts
        PROGRAM_PARSER.format(f"print({value})\nraise SystemExit(1)"),  # a failing program earns nothing
        PROGRAM_PARSER.format(f"import sys\nprint({value}, file=sys.stderr)"),
        PROGRAM_PARSER.format("while True:\n    pass"),
        f"The answer is {value}.",  # right, but not a program
    ]


def program_arithmetic_environment() -> Environment:
    return Environment(
        name="math/python_arithmetic",
        source=ProgramArithmeticSource(),
        renderer=ChatRenderer(PROGRAM_SYSTEM),
        parser=PROGRAM_PARSER,
        rubric=answer_rubric(program_correctness, max_chars=PROGRAM_MAX_CHARS),
        description="integer arithmetic answered by a Python program that the sandbox runs",
        adversarial=_program_adversarial,
        exploits=(printed_literally(PROGRAM_PARSER, lambda task: str(task.data["value"])),),
    )


def register(registry: EnvRegistry) -> None:
    for name in GENERATORS:
        registry.register(f"math/{name}", partial(math_environment, name), source=__name__)
    registry.register("math/python_arithmetic", program_arithmetic_environment, source=__name__)
