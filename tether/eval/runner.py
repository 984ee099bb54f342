"""Evaluation: plan (environment, seed) pairs and run each as an episode against a model.

Each episode runs through `run_episode` (the same protocol as the trainer's rollouts); every model turn
is one `ChatRequest` to a `ChatClient` (the in-process engine, any OpenAI-compatible server, or a
scripted client), with the task's tools as `ToolSpec`s, and the reply's message goes to the episode as
it is. Batching is the client's business: the in-process engine decodes concurrent requests as one
continuous batch. This module neither renders prompts nor parses tool calls; `summary.py` turns the
records into per-domain rows.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tether.chat import ChatClient, ChatRequest, Message, Messages, ToolSpec
from tether.envs.context import ScoringContext
from tether.envs.episode import run_episode
from tether.envs.errors import EnvError
from tether.envs.registry import EnvRegistry, Mixture
from tether.envs.scoring import Score
from tether.envs.tasks import Task
from tether.errors import ConfigError


def plan_episodes(mixture: Mixture, count: int, seed: int, per_env: bool) -> list[tuple[str, int]]:
    """(environment, seed) pairs: `count` per environment, or `count` in all split by the weights."""
    if count < 1:
        raise EnvError(f"episode count {count!r} must be at least 1")
    counts = dict.fromkeys(mixture.names, count) if per_env else mixture.counts(count)
    return [(name, seed + index) for name, n in counts.items() for index in range(n)]


@dataclass(frozen=True, slots=True)
class EvalSettings:
    """How every model turn is asked for, and how many episodes are in flight at once."""

    max_tokens: int = 512  # per model turn
    temperature: float = 0.0  # 0 decodes greedily
    seed: int | None = None  # the sampling seed of every turn when temperature > 0
    concurrency: int = 64  # episodes in flight (and so model requests at most)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens = {self.max_tokens!r}: expected an integer >= 1")
        if self.temperature < 0:
            raise ConfigError(f"temperature = {self.temperature!r}: expected a number >= 0")
        if self.concurrency < 1:
            raise ConfigError(f"concurrency = {self.concurrency!r}: expected an integer >= 1")

    def request(self, messages: Messages, tools: tuple[ToolSpec, ...], step_no: int) -> ChatRequest:
        return ChatRequest(
            messages,
            tools,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=self.seed if self.temperature > 0 else None,
            step_no=step_no,
        )


@dataclass(slots=True)
class EpisodeRecord:
    """One evaluated episode: every reward component, the token counts and the full transcript."""

    env: str
    seed: int
    reference: str
    score: Score | None
    turns: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    transcript: Messages = field(default_factory=list)
    error: str | None = None

    @property
    def reward(self) -> float:
        return self.score.total if self.score is not None else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "env": self.env,
            "seed": self.seed,
            "reference": self.reference,
            "reward": self.reward,
            "passed": bool(self.score and self.score.passed),
            "score": self.score.to_dict() if self.score is not None else None,
            "turns": self.turns,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "sandbox_time_s": self.score.sandbox_time_s if self.score is not None else 0.0,
            "wall_s": self.wall_s,
            "error": self.error,
            "transcript": self.transcript,
        }


async def run_eval(
    registry: EnvRegistry,
    plan: Sequence[tuple[str, int]],
    client: ChatClient,
    ctx: ScoringContext,
    settings: EvalSettings | None = None,
    on_done: Callable[[EpisodeRecord], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> list[EpisodeRecord]:
    """Run every planned episode; an episode that fails is recorded with its error, not raised."""
    settings = settings or EvalSettings()
    for name, _ in plan:
        registry.get(name)  # unknown names fail before any model work
    limit = asyncio.Semaphore(settings.concurrency)

    async def one(name: str, seed: int) -> EpisodeRecord:
        async with limit:
            env = registry.get(name)
            task: Task = env.task(seed)
            record = EpisodeRecord(name, seed, task.reference, None, transcript=list(task.messages))
            asked = 0

            async def policy(messages: Messages, tools: list[dict[str, Any]]) -> Message:
                nonlocal asked
                specs = tuple(ToolSpec.from_openai(tool) for tool in tools)
                completion = await client.complete(settings.request(messages, specs, asked))
                asked += 1
                record.prompt_tokens += completion.usage.prompt_tokens
                record.completion_tokens += completion.usage.completion_tokens
                return completion.message

            start = clock()
            try:
                result = await run_episode(env, task, policy, ctx.child())
                record.score, record.turns, record.transcript = result.score, result.turns, result.messages
            except Exception as error:  # one broken episode must not lose the others' results
                record.error = f"{type(error).__name__}: {error}"
            record.wall_s = clock() - start
            if on_done is not None:
                on_done(record)
            return record

    return list(await asyncio.gather(*(one(name, seed) for name, seed in plan)))
