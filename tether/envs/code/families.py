"""Generated function-writing tasks: the shared shape of a family, its prompt, and how answers are judged.

A family turns a seeded `random.Random` into a `FunctionTask`: a specification with seed-varied
parameters, hidden test inputs, the expected outputs (computed here by trusted reference code), a
reference solution and a plausible wrong one. Only the first `shown` tests appear in the prompt; the
expected outputs never enter the sandbox (the candidate's outputs come back and are compared here).
Running code lives in `runner.py` (Python) and `native.py` (C, C++).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any


class Lang(StrEnum):
    PYTHON = "python"
    C = "c"
    CPP = "cpp"


LANG_NAMES = {Lang.PYTHON: "Python 3", Lang.C: "C (C17)", Lang.CPP: "C++ (C++17)"}
RULES = {
    Lang.PYTHON: "Only define the function (helpers and imports from the standard library are fine); it is "
    "called directly, so do not read input or print.",
    Lang.C: "Only define the function (and helpers); do not write `main`, read input or print. The standard "
    "headers <stdio.h>, <stdlib.h>, <string.h>, <stdint.h> and <limits.h> are already included.",
    Lang.CPP: "Only define the function (and helpers); do not write `main`, read input or print. <string>, "
    "<vector>, <algorithm>, <cstdio> and <cstdlib> are already included, with `using namespace std;`; "
    "include any other header you need.",
}

# Argument and return kinds a native driver knows how to pass; Python takes any JSON data.
KINDS = ("int", "int_list", "string", "bool")


@dataclass(frozen=True, slots=True)
class FunctionTask:
    """One instance of a family: what the model sees, the hidden tests, and two solutions."""

    entry: str
    signature: str
    description: str
    calls: list[list[Any]]  # hidden test inputs, JSON data; the first `shown` appear in the prompt
    expected: list[Any]
    reference: str
    mutant: str  # a plausible wrong solution: must fail at least one hidden test
    arg_kinds: tuple[str, ...] = ()  # native languages only
    returns: str = ""  # native languages only
    shown: int = 2

    def __post_init__(self) -> None:
        assert len(self.calls) == len(self.expected) > self.shown, "need more hidden tests than examples"
        for kind in (*self.arg_kinds, *([self.returns] if self.returns else [])):
            assert kind in KINDS, f"unknown kind {kind!r}"


@dataclass(frozen=True, slots=True)
class Family:
    """A generator of `FunctionTask`s in one language."""

    name: str  # e.g. "py-caesar"; the environment is `code/<name>`
    language: Lang
    summary: str
    make: Callable[[random.Random], FunctionTask] = field(repr=False)

    def task(self, seed: int) -> FunctionTask:
        rng = random.Random(f"{self.name}:{seed}")
        task = self.make(rng)
        # Shuffled, so that the examples in the prompt (the first few) differ from seed to seed too.
        order = list(range(len(task.calls)))
        rng.shuffle(order)
        return replace(task, calls=[task.calls[i] for i in order], expected=[task.expected[i] for i in order])


def literal(value: Any, language: Lang) -> str:
    """How an example value is written in the prompt."""
    if language is Lang.PYTHON:
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "{" + ", ".join(literal(item, language) for item in value) + "}"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def render_prompt(task: FunctionTask, language: Lang) -> str:
    examples = "\n".join(
        f"    {task.entry}({', '.join(literal(arg, language) for arg in args)}) -> {literal(out, language)}"
        for args, out in zip(task.calls[: task.shown], task.expected[: task.shown], strict=True)
    )
    return (
        f"Write a {LANG_NAMES[language]} function with this signature:\n\n    {task.signature}\n\n"
        f"{task.description}\n\nExamples:\n{examples}\n\n{RULES[language]} "
        "It will be run against hidden tests."
    )


def same_value(got: Any, want: Any) -> bool:
    """Equality without coercion: True is not 1, a tuple is not a list; floats to 1e-9 relative."""
    if type(want) is float and type(got) in (int, float):
        return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
    if type(got) is not type(want):
        return False
    if isinstance(want, list | tuple):
        return len(got) == len(want) and all(same_value(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(same_value(got[k], want[k]) for k in want)
    return bool(got == want)


# --- random inputs shared by the families ------------------------------------------------------------


def ints(rng: random.Random, count: int, low: int, high: int) -> list[int]:
    return [rng.randint(low, high) for _ in range(count)]


def word(
    rng: random.Random, alphabet: str = "abcdefghijklmnopqrstuvwxyz", low: int = 1, high: int = 8
) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(low, high)))


def text(rng: random.Random, alphabet: str, low: int, high: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(low, high)))
