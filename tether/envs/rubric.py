"""Reward components shared by many domains: format adherence and length, plus the usual rubric shape.

A domain supplies its own correctness check; `answer_rubric` wraps it with the standard weights so
that every domain's rewards read the same way in logs (`correctness`, `format`, `length`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tether.envs.scoring import Reward, RewardInput, Rubric
from tether.envs.tasks import Parser


def format_followed(inp: RewardInput) -> float:
    """1 when the completion stated exactly one answer the way the system prompt asked."""
    return 1.0 if inp.parsed.well_formed else 0.0


def length_within(max_chars: int) -> Callable[[RewardInput], float]:
    """1 up to `max_chars` characters of completion, falling linearly to 0 at twice that."""
    if max_chars <= 0:
        raise ValueError(f"max_chars {max_chars!r} must be positive")

    def length(inp: RewardInput) -> float:
        excess = len(inp.completion) - max_chars
        return 1.0 if excess <= 0 else max(0.0, 1.0 - excess / max_chars)

    return length


def answer_rubric(
    correctness: Callable[[RewardInput], float | Awaitable[float]],
    *,
    max_chars: int = 8000,
    correctness_weight: float = 0.8,
    format_weight: float = 0.1,
    length_weight: float = 0.1,
) -> Rubric:
    """Correctness gates the total, so format and brevity only pay on a right answer."""
    return Rubric(
        (
            Reward("correctness", correctness, correctness_weight, gate=True),
            Reward("format", format_followed, format_weight),
            Reward("length", length_within(max_chars), length_weight),
        )
    )


def hedged(parser: Parser, answer: str) -> str:
    """A completion that offers a wrong answer and the right one: it must never score."""
    return parser.format("tether-wrong-answer-0xdead") + "\n" + parser.format(answer)
