"""Errors a user can cause, with messages that name the bad value and what would be accepted."""

from __future__ import annotations

from pydantic import BaseModel, ValidationError


class TetherError(Exception):
    """Base of every error tether raises on purpose."""


class ConfigError(TetherError, ValueError):
    """A configuration value (file, environment, flag or request) is unknown or invalid."""


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
