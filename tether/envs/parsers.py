"""Answer-extraction conventions: how a completion states its final answer, and how we read it back.

The convention is stated in the system prompt (`instructions`) and rewarded by the rubric's format
component. Parsing is strict on purpose: a completion that offers several different answers gets none,
so listing candidates never beats committing to one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tether.envs.tasks import Parsed


@dataclass(frozen=True, slots=True)
class TagParser:
    """The answer is the text between `<answer>` and `</answer>` (the tag name is configurable)."""

    tag: str = "answer"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z_]+", self.tag):
            raise ValueError(f"tag {self.tag!r}: expected lowercase letters and '_'")

    @property
    def instructions(self) -> str:
        return (
            f"Think as needed, then give your final answer exactly once, alone between <{self.tag}> and "
            f"</{self.tag}> tags, for example <{self.tag}>42</{self.tag}>."
        )

    def parse(self, completion: str) -> Parsed:
        blocks = [b.strip() for b in re.findall(rf"<{self.tag}>(.*?)</{self.tag}>", completion, re.DOTALL)]
        if not blocks:
            return Parsed(None, False)
        if len(set(blocks)) > 1:  # several different answers: refuse to pick one for the model
            return Parsed(None, False)
        # A nested or unbalanced tag inside the answer means the convention was not followed.
        clean = (
            len(blocks) == 1 and f"<{self.tag}>" not in blocks[0] and completion.count(f"</{self.tag}>") == 1
        )
        return Parsed(blocks[0], clean)

    def format(self, answer: str) -> str:
        return f"<{self.tag}>{answer}</{self.tag}>"


ANSWER_TAG = TagParser()
