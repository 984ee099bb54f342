"""The code environments, composed from the pieces of this package, and their registration.

`code/humaneval` and one `code/<family>` per generated family (Python, C, C++). Rubric: `correctness`
(gate: every hidden test passes), `tests` (the fraction that pass, a denser signal), `format` (exactly
one code block in the right language), `length` (brevity of the completion).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from tether.envs.code import humaneval
from tether.envs.code.extract import LANGUAGE_TAGS, CodeBlockParser
from tether.envs.code.families import LANG_NAMES, Family, FunctionTask, Lang, render_prompt, same_value
from tether.envs.code.native import run_native
from tether.envs.code.native_families import NATIVE_FAMILIES
from tether.envs.code.py_families import PYTHON_FAMILIES
from tether.envs.code.runner import run_calls
from tether.envs.episode import Environment
from tether.envs.registry import EnvRegistry
from tether.envs.rubric import format_followed, length_within
from tether.envs.scoring import Reward, RewardInput, Rubric
from tether.envs.tasks import ChatRenderer, Problem, Task

FAMILIES: tuple[Family, ...] = (*PYTHON_FAMILIES, *NATIVE_FAMILIES)
MAX_ANSWER_CHARS = 4000  # full length reward up to here: every task has a solution of a few hundred
_RESULTS = "code.test_results"  # EpisodeState.info key: one sandbox run serves every reward component


def system_prompt(language: Lang) -> str:
    return (
        f"You are an expert {LANG_NAMES[language]} programmer. "
        + CodeBlockParser(language.value).instructions
    )


@dataclass(frozen=True, slots=True)
class FamilySource:
    family: Family

    def problem(self, seed: int) -> Problem:
        task = self.family.task(seed)
        data: dict[str, Any] = {
            "language": self.family.language.value,
            "entry": task.entry,
            "calls": task.calls,
            "expected": task.expected,
            "arg_kinds": list(task.arg_kinds),
            "returns": task.returns,
        }
        return Problem(prompt=render_prompt(task, self.family.language), answer=task.reference, data=data)


def task_from_data(data: dict[str, Any], reference: str = "") -> FunctionTask:
    """The judging view of a task (inputs, expected outputs, kinds) from its JSON record."""
    return FunctionTask(
        entry=str(data["entry"]),
        signature="",
        description="",
        calls=list(data["calls"]),
        expected=list(data["expected"]),
        reference=reference,
        mutant="",
        arg_kinds=tuple(data.get("arg_kinds", ())),
        returns=str(data.get("returns", "")),
        shown=0,
    )


async def judge_function(inp: RewardInput) -> list[bool]:
    """Which hidden tests the parsed answer passes (all False without an answer)."""
    data = inp.task.data
    if inp.parsed.answer is None:
        return [False] * len(data["calls"])
    language = Lang(data["language"])
    task = task_from_data(data)
    if language is Lang.PYTHON:
        outcomes = await run_calls(inp.ctx, inp.parsed.answer, task.entry, task.calls)
        return [o.ok and same_value(o.value, want) for o, want in zip(outcomes, task.expected, strict=True)]
    return await run_native(inp.ctx, task, language, inp.parsed.answer)


async def judge_humaneval(inp: RewardInput) -> list[bool]:
    if inp.parsed.answer is None:
        return [False]
    return [await humaneval.passes(inp.ctx, str(inp.task.data["task_id"]), inp.parsed.answer)]


def code_rubric(judge: Callable[[RewardInput], Awaitable[list[bool]]]) -> Rubric:
    async def results(inp: RewardInput) -> list[bool]:
        cache = inp.state.info if inp.state is not None else {}
        if _RESULTS not in cache:
            cache[_RESULTS] = await judge(inp)
        found: list[bool] = cache[_RESULTS]
        return found

    async def correctness(inp: RewardInput) -> float:
        passed = await results(inp)
        return 1.0 if passed and all(passed) else 0.0

    async def tests(inp: RewardInput) -> float:
        passed = await results(inp)
        return sum(passed) / len(passed) if passed else 0.0

    return Rubric(
        (
            Reward("correctness", correctness, 0.8, gate=True),
            Reward("tests", tests, 0.1),
            Reward("format", format_followed, 0.05),
            Reward("length", length_within(MAX_ANSWER_CHARS), 0.05),
        )
    )


def _wrapped_in_formats(answer: str, language: Lang) -> str:
    """The same answer offered as several differently-tagged blocks: hedging must not pay."""
    tags = [LANGUAGE_TAGS[language.value][0], "c" if language is Lang.PYTHON else "python", "text"]
    return "\n".join(f"```{tag}\n{answer.rstrip()}\n```" for tag in tags)


def family_adversarial(family: Family) -> Callable[[Task], list[str]]:
    parser = CodeBlockParser(family.language.value)

    def answers(task: Task) -> list[str]:
        generated = family.task(task.seed)
        shown = dict(
            zip((repr(c) for c in generated.calls[: generated.shown]), generated.expected, strict=False)
        )
        out = [parser.format(generated.mutant), _wrapped_in_formats(generated.reference, family.language)]
        if family.language is Lang.PYTHON:
            # Hard-codes the examples from the prompt: the hidden tests go further.
            out.append(
                parser.format(f"def {generated.entry}(*args):\n    return {shown!r}.get(repr(list(args)))\n")
            )
            out.append(
                parser.format(f"def {generated.entry}(*args):\n    print({generated.expected[0]!r})\n")
            )
            out.append(parser.format("import os\nos._exit(0)\n"))
        else:
            # Its own main that prints the examples' answers: the driver's main must be the one to run.
            prints = "\n".join(f'    puts("{i} {value}");' for i, value in enumerate(generated.expected))
            out.append(parser.format(f"#include <stdio.h>\nint main(void) {{\n{prints}\n    return 0;\n}}\n"))
        return out

    return answers


def family_env(family: Family) -> Environment:
    parser = CodeBlockParser(family.language.value)
    return Environment(
        name=f"code/{family.name}",
        source=FamilySource(family),
        renderer=ChatRenderer(system_prompt(family.language)),
        parser=parser,
        rubric=code_rubric(judge_function),
        description=f"{LANG_NAMES[family.language]}: {family.summary}; hidden tests run in the sandbox",
        adversarial=family_adversarial(family),
    )


def humaneval_adversarial(task: Task) -> list[str]:
    parser = CodeBlockParser("python")
    answers = [parser.format(a) for a in humaneval.adversarial_answers(str(task.data["task_id"]))]
    return [*answers, _wrapped_in_formats(task.reference, Lang.PYTHON)]


def humaneval_env() -> Environment:
    return Environment(
        name="code/humaneval",
        source=humaneval.HumanEvalSource(),
        renderer=ChatRenderer(system_prompt(Lang.PYTHON)),
        parser=CodeBlockParser("python"),
        rubric=code_rubric(judge_humaneval),
        description="HumanEval (164 problems), the dataset's checks run in the sandbox",
        adversarial=humaneval_adversarial,
    )


def register(registry: EnvRegistry) -> None:
    registry.register("code/humaneval", humaneval_env, source=__name__)
    for family in FAMILIES:
        registry.register(f"code/{family.name}", partial(family_env, family), source=__name__)
