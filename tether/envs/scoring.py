"""Scoring: the state of an episode that tools, validators and rewards look at, the reward components,
and the rubric that weighs them into one `Score`."""

from __future__ import annotations

import contextlib
import inspect
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tether.chat import Messages, message_text
from tether.envs.context import ScoringContext
from tether.envs.errors import EnvError
from tether.envs.tasks import Parsed, Task
from tether.errors import InfraError, InfraReason
from tether.tools.workspace import SandboxWorkspace

if TYPE_CHECKING:
    from tether.sandbox.interface import Session
    from tether.sandbox.result import RunResult


@dataclass(slots=True)
class EpisodeState:
    """Everything a tool, a validator or a reward function may look at; `info` is the domain's scratch."""

    task: Task
    ctx: ScoringContext
    messages: Messages
    session: Session | None = None
    turns: int = 0
    tool_calls: int = 0
    submitted: str | None = None
    qc_violation: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def require_session(self) -> Session:
        if self.session is None:
            raise EnvError(f"environment {self.task.env} has no sandbox session in this episode")
        return self.session

    def workspace(self) -> SandboxWorkspace:
        """The session's working directory as tools see it, its sandbox time counted in `ctx`; a run
        the sandbox fails raises `InfraError` (not the model's doing)."""
        return SandboxWorkspace(self.require_session(), self.ctx.timed, infra_errors=True)

    async def run(self, code: str | bytes, language: str = "python", **kwargs: Any) -> RunResult:
        """Run in the episode's sandbox session (files persist between runs), timed."""
        return await self.workspace().run(code, language, **kwargs)

    @property
    def final_text(self) -> str:
        """The last assistant message's text (the answer of a single-turn episode)."""
        for message in reversed(self.messages):
            if message.get("role") == "assistant":
                return message_text(message)
        return ""


@dataclass(frozen=True, slots=True)
class RewardInput:
    """What every reward function receives; `state` is None when scoring a bare completion."""

    task: Task
    completion: str
    parsed: Parsed
    ctx: ScoringContext
    state: EpisodeState | None = None
    # Reward functions may note why they scored as they did (failing test, error); it becomes Score.detail.
    detail: dict[str, Any] = field(default_factory=dict)


RewardFn = Callable[[RewardInput], float | Awaitable[float]]


@dataclass(frozen=True, slots=True)
class Reward:
    """A named reward component in [0, 1]. A gate multiplies the total: a wrong answer earns nothing."""

    name: str
    fn: RewardFn
    weight: float = 1.0
    gate: bool = False

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise ValueError(f"reward name {self.name!r}: expected lowercase letters, digits and '_'")
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise ValueError(f"reward {self.name!r}: weight {self.weight!r} must be finite and >= 0")


@dataclass(frozen=True, slots=True)
class Score:
    """Every component of one rollout's reward, the total, and why it was zeroed if it was."""

    total: float
    components: dict[str, float]
    weights: dict[str, float]
    passed: bool  # the pass component scored 1.0 (pass rate in eval)
    answer: str | None = None
    qc_violation: str | None = None
    sandbox_time_s: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "components": self.components,
            "weights": self.weights,
            "passed": self.passed,
            "answer": self.answer,
            "qc_violation": self.qc_violation,
            "sandbox_time_s": self.sandbox_time_s,
            "detail": self.detail,
        }


def _valid_reward(name: str, value: object) -> float:
    """A reward function's value as a float in [0, 1]. Anything else (None, NaN, out of range) is no
    verdict on the answer: an `InfraError`, so RL leaves the sample out instead of learning from it."""
    number = math.nan
    if value is not None and not isinstance(value, str | bytes):  # text is no number, even "1"
        with contextlib.suppress(TypeError, ValueError):
            number = float(value)  # type: ignore[arg-type]  # bools, numpy and torch scalars count
    if not 0.0 <= number <= 1.0:  # the comparison also rejects NaN
        raise InfraError(InfraReason.INVALID_REWARD, f"reward {name!r} returned {value!r}, outside [0, 1]")
    return number


@dataclass(frozen=True, slots=True)
class Rubric:
    """Weighted components: total = (product of gates) * (weighted mean of all components)."""

    rewards: tuple[Reward, ...]
    pass_component: str | None = None  # default: the first gate, else the first component

    def __post_init__(self) -> None:
        if not self.rewards:
            raise ValueError("a rubric needs at least one reward")
        names = [reward.name for reward in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be unique, got {names}")
        if sum(reward.weight for reward in self.rewards) <= 0:
            raise ValueError("the rubric's weights sum to 0")
        if self.pass_component is not None and self.pass_component not in names:
            raise ValueError(f"pass_component {self.pass_component!r} is not one of {names}")

    @property
    def names(self) -> list[str]:
        return [reward.name for reward in self.rewards]

    def extended(self, extra: tuple[Reward, ...]) -> Rubric:
        """This rubric with `extra` components after its own; what counts as passed does not change."""
        return Rubric(self.rewards + extra, pass_component=self.passing)

    @property
    def passing(self) -> str:
        if self.pass_component is not None:
            return self.pass_component
        gates = [reward.name for reward in self.rewards if reward.gate]
        return gates[0] if gates else self.rewards[0].name

    async def score(self, inp: RewardInput) -> Score:
        components: dict[str, float] = {}
        for reward in self.rewards:
            value = reward.fn(inp)
            if inspect.isawaitable(value):
                value = await value
            components[reward.name] = _valid_reward(reward.name, value)
        weights = {reward.name: reward.weight for reward in self.rewards}
        mean = sum(components[n] * w for n, w in weights.items()) / sum(weights.values())
        gate = math.prod(components[reward.name] for reward in self.rewards if reward.gate)
        return Score(
            total=gate * mean,
            components=components,
            weights=weights,
            passed=components[self.passing] >= 1.0,
            answer=inp.parsed.answer,
            sandbox_time_s=inp.ctx.sandbox_time_s,
            detail=dict(inp.detail),
        )

    def zero(self, reason: str, ctx: ScoringContext) -> Score:
        """The score of an episode ended by a quality-check violation."""
        return Score(
            total=0.0,
            components=dict.fromkeys(self.names, 0.0),
            weights={reward.name: reward.weight for reward in self.rewards},
            passed=False,
            qc_violation=reason,
            sandbox_time_s=ctx.sandbox_time_s,
        )
