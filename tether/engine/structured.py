"""Structured output: the grammar a request's tokens must follow (a JSON schema, any JSON object, a Lark
grammar or a regular expression), stated in `SamplingParams.structured` and enforced while decoding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tether.errors import ConfigError

GrammarKind = Literal["json_schema", "json_object", "lark", "regex"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "json_object", "lark", "regex")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """`spec`: the schema as JSON text (json_schema), empty (json_object), the grammar or the pattern."""

    kind: GrammarKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ConfigError(
                f"structured output kind {self.kind!r}: expected one of {', '.join(GRAMMAR_KINDS)}"
            )
        if self.kind != "json_object" and not self.spec:
            raise ConfigError(f"structured output {self.kind}: the {self.kind} is empty")
