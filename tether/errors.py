"""Errors a user can cause, with messages that name the bad value and what would be accepted."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable

from pydantic import BaseModel, ValidationError


class TetherError(Exception):
    """Base of every error tether raises on purpose."""


class ConfigError(TetherError, ValueError):
    """A configuration value (file, environment, flag or request) is unknown or invalid."""


def did_you_mean(name: str, known: Iterable[str], spell: Callable[[str], str] = repr) -> str:
    """`; did you mean 'x'?` naming the known name closest to a mistyped one, or '' when none is close
    (a suggestion by spelling, not the first name in the list)."""
    matches = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean {spell(matches[0])}?" if matches else ""


def describe_validation_error(
    error: ValidationError, source: str, model: type[BaseModel] | None = None
) -> str:
    """One line per problem: `source: key = value: what is accepted`."""
    lines = []
    for problem in error.errors():
        key = ".".join(str(part) for part in problem["loc"]) or "(root)"
        if problem["type"] == "extra_forbidden":
            known = f"; known keys: {', '.join(sorted(model.model_fields))}" if model is not None else ""
            lines.append(f"{source}: unknown key {key!r} (value {problem['input']!r}){known}")
        else:
            lines.append(f"{source}: {key} = {problem['input']!r}: {problem['msg']}")
    return "\n".join(lines)


def lone_surrogate(text: str) -> str | None:
    """Where `text` holds a lone UTF-16 surrogate, which is valid JSON (an escape such as `\\ud800`) but no
    character: neither a tokenizer, a file name nor a UTF-8 response can hold it. None for valid text."""
    try:
        text.encode()
    except UnicodeEncodeError as error:
        return (
            f"a lone UTF-16 surrogate {text[error.start]!r} (U+{ord(text[error.start]):04X}) at index "
            f"{error.start}, which is not valid Unicode; send surrogates only in pairs"
        )
    return None
