"""`bench/integer_arithmetic`: the task `tether rl bench` times and `tether demo` trains on.

`a op b` from a seed, reward 1 when the completion's last integer is the answer. Deliberately free of
tags and tools, so that an untrained small model can score and TRL's reward function (`reward`) can
compute the same figure from plain text.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from tether.envs.episode import Environment
from tether.envs.registry import EnvRegistry
from tether.envs.scoring import Reward, RewardInput, Rubric
from tether.envs.tasks import ChatRenderer, Parsed, Problem

BENCH_ENV = "bench/integer_arithmetic"
SYSTEM = "Solve the arithmetic problem. End your reply with the final answer as a plain integer."
_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True, slots=True)
class IntegerArithmetic:
    """`a op b` with op in + - * and two-digit operands (one digit for products): integer answers."""

    def problem(self, seed: int) -> Problem:
        rng = random.Random(seed)
        op = rng.choice("+-*")
        a, b = rng.randint(2, 99), rng.randint(2, 9 if op == "*" else 99)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Problem(prompt=f"What is {a} {op} {b}?", answer=str(value))


def final_integer(text: str) -> int | None:
    """The last integer written in `text` (a leading minus counts), or None."""
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


def reward(completion: str, reference: str) -> float:
    """1.0 when the completion's last integer is the reference answer, else 0.0."""
    return 1.0 if final_integer(completion) == int(reference) else 0.0


@dataclass(frozen=True, slots=True)
class FinalInteger:
    instructions: str = "End with the final answer as a plain integer."

    def parse(self, completion: str) -> Parsed:
        value = final_integer(completion)
        return Parsed(None if value is None else str(value), value is not None)

    def format(self, answer: str) -> str:
        return f"The answer is {answer}."


def _correct(inp: RewardInput) -> float:
    return reward(inp.completion, inp.task.reference)


def integer_arithmetic_environment() -> Environment:
    return Environment(
        name=BENCH_ENV,
        source=IntegerArithmetic(),
        renderer=ChatRenderer(SYSTEM),
        parser=FinalInteger(),
        rubric=Rubric((Reward("correct", _correct),)),
        description="integer arithmetic; reward 1 for the right final integer (tether rl bench)",
    )


def register(registry: EnvRegistry) -> None:
    registry.register(BENCH_ENV, integer_arithmetic_environment, source=__name__)
