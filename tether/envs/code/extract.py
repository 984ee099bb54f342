"""Reading the code out of a completion: exactly one fenced block, in the expected language.

Strict on purpose: a completion that offers several different blocks (the same idea in Python, C and
plain text, say) gets nothing, so hedging across formats never beats committing to one answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tether.envs.tasks import Parsed

_FENCE = re.compile(r"^```[ \t]*([A-Za-z0-9_+#-]*)[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)

LANGUAGE_TAGS = {
    "python": ("python", "py", "python3"),
    "c": ("c",),
    "cpp": ("cpp", "c++", "cc", "cxx"),
    "sql": ("sql", "sqlite"),
}


@dataclass(slots=True)
class CodeBlockParser:
    """The answer is the body of the completion's only fenced code block (untagged or tagged `language`)."""

    language: str = "python"
    instructions: str = field(init=False)  # the system prompt's sentence (the `Parser` protocol)

    def __post_init__(self) -> None:
        if self.language not in LANGUAGE_TAGS:
            raise ValueError(f"language {self.language!r}: expected one of {', '.join(LANGUAGE_TAGS)}")
        tag = LANGUAGE_TAGS[self.language][0]
        self.instructions = (
            f"Answer with exactly one fenced code block (```{tag} ... ```) holding your complete solution; "
            "do not include any other code block."
        )

    def parse(self, completion: str) -> Parsed:
        blocks = _FENCE.findall(completion)
        if len(blocks) != 1:
            return Parsed(None, False)
        tag, body = blocks[0]
        if tag and tag.lower() not in LANGUAGE_TAGS[self.language]:
            return Parsed(None, False)
        code = body.rstrip()
        return (Parsed(code + "\n", True)) if code.strip() else Parsed(None, False)

    def format(self, answer: str) -> str:
        return f"```{LANGUAGE_TAGS[self.language][0]}\n{answer.rstrip()}\n```"
