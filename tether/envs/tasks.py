"""Tasks: what a task source produces for a seed (`Problem`), how it is rendered into chat messages
and logged (`Task`), and how an answer is read back from a completion (`Parser`). Generators whose
random draw can come out already solved re-draw it with `draw_unsolved`, so no task rewards doing
nothing."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from tether.chat import Messages
from tether.envs.errors import EnvError

NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-+]*$")
MAX_SEED = 2**63 - 1
# A generator whose draws come out solved this often in a row is broken, not unlucky.
MAX_REDRAWS = 64

Drawn = TypeVar("Drawn")


def check_name(name: str) -> str:
    """`family/name`: lowercase family, then a name of letters, digits and `_.-+`."""
    if not NAME_PATTERN.match(name):
        raise EnvError(
            f"environment name {name!r} is invalid: expected 'family/name' "
            "(family: lowercase letters, digits, '_.-'; name: letters, digits, '_.-+')"
        )
    return name


def check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise EnvError(f"seed {seed!r} is invalid: expected an integer between 0 and 2**63-1")
    return seed


def check_json(value: Any, what: str) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{what} must be JSON-serialisable: {error}") from None


def redraw_seed(seed: int, attempt: int) -> int:
    """The seed of the `attempt`-th draw for `seed`: the seed itself first (so a task that was fine stays
    exactly as it was), then seeds derived from it by hashing, in [0, MAX_SEED]."""
    if attempt == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/redraw/{attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & MAX_SEED


def draw_unsolved(
    draw: Callable[[int], Drawn], solved_untouched: Callable[[Drawn], bool], seed: int, what: str
) -> Drawn:
    """`draw(seed)`, re-drawn from `redraw_seed(seed, 1)`, `(seed, 2)`, ... while `solved_untouched` says
    the drawn task is already solved before the model does anything (an answer that does nothing would
    score). Deterministic: the same seed always gives the same task."""
    for attempt in range(MAX_REDRAWS):
        drawn = draw(redraw_seed(seed, attempt))
        if not solved_untouched(drawn):
            return drawn
    raise EnvError(
        f"{what} seed {seed}: {MAX_REDRAWS} draws in a row were solved before any action; "
        "the generator cannot produce a task that needs work"
    )


@dataclass(frozen=True, slots=True)
class Problem:
    """What a task source produces for one seed, before rendering."""

    prompt: str  # the user-facing question (the renderer wraps it in chat messages)
    answer: str  # the reference answer, in the form the parser extracts (not wrapped in tags)
    data: dict[str, Any] = field(default_factory=dict)  # JSON: whatever the rubric needs to check


@dataclass(frozen=True, slots=True)
class Task:
    """One seeded instance of an environment, ready to send to a model and to log as JSON."""

    env: str
    seed: int
    messages: Messages
    reference: str
    data: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI `tools` entries; empty: single-turn
    max_turns: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "env": self.env,
            "seed": self.seed,
            "messages": self.messages,
            "reference": self.reference,
            "data": self.data,
            "tools": self.tools,
            "max_turns": self.max_turns,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Task:
        missing = {"env", "seed", "messages", "reference"} - set(raw)
        if missing:
            raise EnvError(f"task is missing {', '.join(sorted(missing))}")
        expected = {"messages": list, "reference": str, "data": dict, "tools": list, "max_turns": int}
        for key, kind in expected.items():
            if key in raw and (not isinstance(raw[key], kind) or isinstance(raw[key], bool)):
                raise EnvError(f"task {key} = {raw[key]!r}: expected a {kind.__name__}")
        return cls(
            env=check_name(str(raw["env"])),
            seed=check_seed(raw["seed"]),
            messages=list(raw["messages"]),
            reference=raw["reference"],
            data=dict(raw.get("data", {})),
            tools=list(raw.get("tools", [])),
            max_turns=raw.get("max_turns", 1),
        )


class TaskSource(Protocol):
    """Seeded and reproducible: the same seed always gives the same problem."""

    def problem(self, seed: int) -> Problem: ...


class Renderer(Protocol):
    def render(self, problem: Problem) -> Messages: ...


@dataclass(frozen=True, slots=True)
class ChatRenderer:
    """A fixed system prompt and the problem as the user turn; fixed so that prefix caching pays."""

    system: str

    def render(self, problem: Problem) -> Messages:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": problem.prompt}]


@dataclass(frozen=True, slots=True)
class Parsed:
    """The answer extracted from a completion, and whether the completion followed the convention."""

    answer: str | None
    well_formed: bool


class Parser(Protocol):
    @property
    def instructions(self) -> str:
        """The sentence of the system prompt that states the convention."""
        ...

    def parse(self, completion: str) -> Parsed: ...

    def format(self, answer: str) -> str:
        """A completion that states `answer` exactly as the convention asks (reference completions)."""
        ...
