"""Errors a user can cause, with messages that name the bad value and what would be accepted."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from enum import StrEnum

from pydantic import BaseModel, ValidationError


class TetherError(Exception):
    """Base of every error tether raises on purpose."""


class ConfigError(TetherError, ValueError):
    """A configuration value (file, environment, flag or request) is unknown or invalid."""


class InfraReason(StrEnum):
    """Why a sample could not be scored for reasons that are not the model's: RL leaves such samples out
    of the advantages (retrying them first) instead of scoring them like a wrong answer."""

    SANDBOX_ERROR = "sandbox_error"  # the sandbox could not run the program (worker died, setup failed)
    SANDBOX_QC = "sandbox_qc"  # the sandbox's quality check failed the worker after the run
    SCORER_TIMEOUT = "scorer_timeout"  # scoring did not finish within its deadline
    SCORER_ERROR = "scorer_error"  # a reward function or grader raised
    INVALID_REWARD = "invalid_reward"  # a reward was NaN, None or outside its range
    ENGINE_FAILURE = "engine_failure"  # the engine or a rollout server failed the request
    WORKER_LOST = "worker_lost"  # the rollout worker holding the sample died or stopped answering
    JUDGE_ERROR = "judge_error"  # an LLM judge or reward model gave no usable verdict


class InfraError(TetherError):
    """Work failed for an infrastructure reason (see `InfraReason`), not because of the model's output."""

    def __init__(self, reason: InfraReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


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
