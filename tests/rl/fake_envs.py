"""Pure-Python environments for trainer tests: rewards a tiny random model's output can move."""

from __future__ import annotations

from dataclasses import dataclass

from tether.envs.episode import Environment
from tether.envs.registry import EnvRegistry
from tether.envs.scoring import Reward, RewardFn, RewardInput, Rubric
from tether.envs.tasks import ChatRenderer, Parsed, Problem


@dataclass(frozen=True, slots=True)
class _Source:
    word: str

    def problem(self, seed: int) -> Problem:
        return Problem(prompt=f"{self.word} {seed % 7}", answer=self.word)


@dataclass(frozen=True, slots=True)
class _Raw:
    instructions: str = "Answer."

    def parse(self, completion: str) -> Parsed:
        return Parsed(completion.strip(), True)

    def format(self, answer: str) -> str:
        return answer


def _share_in(chars: str) -> Reward:
    def share(inp: RewardInput) -> float:
        text = inp.completion
        return sum(c in chars for c in text) / len(text) if text else 0.0

    return Reward("share", share, weight=0.75)


def _short(inp: RewardInput) -> float:
    return 1.0 if len(inp.completion) <= 8 else 0.0


def letters_env(name: str, chars: str) -> Environment:
    """Reward: the share of completion characters in `chars` (0.75), and brevity (0.25)."""
    return Environment(
        name=name,
        source=_Source(name.split("/")[1]),
        renderer=ChatRenderer("You are a test."),
        parser=_Raw(),
        rubric=Rubric((_share_in(chars), Reward("short", _short, weight=0.25))),
    )


def fake_registry() -> EnvRegistry:
    registry = EnvRegistry()
    registry.add(letters_env("test/vowels", "aeiou"))
    registry.add(letters_env("test/digits", "0123456789"))
    return registry


def reward_env(name: str, reward: RewardFn) -> Environment:
    """An environment of one reward component, `value`, scored by `reward`."""
    return Environment(
        name=name,
        source=_Source(name.split("/")[1]),
        renderer=ChatRenderer("You are a test."),
        parser=_Raw(),
        rubric=Rubric((Reward("value", reward),)),
    )
