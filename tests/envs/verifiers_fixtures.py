"""verifiers environments written with verifiers' own classes, for the adapter's tests and the RL test.

`verifiers` is part of the dev install (`tether[verifiers]`); it is skipped only when a run sets
TETHER_NO_VERIFIERS=1 on purpose, never because it is missing by accident.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import pytest

if os.environ.get("TETHER_NO_VERIFIERS") == "1":
    vf = pytest.importorskip("verifiers")
else:
    import verifiers as vf  # the dev install has it: a missing package must fail, not skip

from datasets import Dataset

QUESTIONS = [
    {"question": "What is 2 + 3?", "answer": "5"},
    {"question": "What is 4 + 4?", "answer": "8"},
    {"question": "What is 1 + 6?", "answer": "7"},
]
SYSTEM = "Think, then answer inside <answer> tags."


def single_turn_env() -> Any:
    """A SingleTurnEnv: XML answer, correctness and the parser's format reward, weights 1.0 and 0.2."""
    parser = vf.XMLParser(["think", "answer"], answer_field="answer")

    def correct_answer(completion: Any, answer: str, parser: Any, **kwargs: Any) -> float:
        return 1.0 if parser.parse_answer(completion) == answer else 0.0

    async def brevity(completion: Any) -> float:  # async and without **kwargs: only what it names
        return 1.0 if len(completion[-1]["content"]) < 60 else 0.5

    rubric = vf.Rubric(
        funcs=[correct_answer, parser.get_format_reward_func(), brevity],
        weights=[1.0, 0.2, -0.1],
        parser=parser,
    )
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(QUESTIONS), system_prompt=SYSTEM, parser=parser, rubric=rubric
    )


class GuessEnv(vf.MultiTurnEnv):
    """Guess the number: the environment says higher or lower until the guess is right."""

    async def is_completed(self, messages: Any, state: Any, **kwargs: Any) -> bool:
        return bool(state.get("solved")) or await self.max_turns_reached(state)

    async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> tuple[list[Any], Any]:
        guess = messages[-1]["content"].strip()
        target = int(state["answer"])
        if guess == str(target):
            state["solved"] = True
            return [{"role": "user", "content": "correct"}], state
        hint = "higher" if guess.isdigit() and int(guess) < target else "lower"
        return [{"role": "user", "content": hint}], state


def multi_turn_env() -> Any:
    def solved(state: Any, **kwargs: Any) -> float:
        return 1.0 if state.get("solved") else 0.0

    def turns_used(state: Any, **kwargs: Any) -> float:
        return state["turn"] / 4

    rows = [{"question": "Guess my number between 1 and 9.", "answer": "6"}]
    return GuessEnv(
        dataset=Dataset.from_list(rows),
        system_prompt="Reply with one number.",
        rubric=vf.Rubric(funcs=[solved, turns_used], weights=[1.0, -0.5]),
        max_turns=4,
    )


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def tool_env() -> Any:
    def correct_answer(completion: Any, answer: str, **kwargs: Any) -> float:
        return 1.0 if answer in str(completion[-1].get("content", "")) else 0.0

    def used_tool(completion: Any, **kwargs: Any) -> float:
        return 1.0 if any(m["role"] == "tool" for m in completion) else 0.0

    return vf.ToolEnv(
        tools=[add],
        dataset=Dataset.from_list(QUESTIONS),
        system_prompt="Use the add tool, then state the sum.",
        rubric=vf.Rubric(funcs=[correct_answer, used_tool], weights=[0.8, 0.2]),
        max_turns=3,
    )


def install_module(name: str, **attributes: Any) -> types.ModuleType:
    """A module importable by `name` (what a Hub package installs), holding `attributes`."""
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module
