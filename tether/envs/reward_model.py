"""A reward model as a reward component: whole conversations scored in [0, 1] by a `ConversationScorer`,
many at once.

Environments know no model: the scorer is anything that maps conversations to scores (the training
side's sequence classifier, `tether.rl.rewards.ClassifierScorer`, or a test's function). Rollouts of a
batch reach their reward-model component at about the same time; `RewardModelReward` collects those
that arrive together into batches of at most `max_batch` and scores each in a worker thread, so the
event loop keeps scoring the rest meanwhile. A scorer that raises, or returns anything but one finite
score in [0, 1] per conversation, raises `InfraError(JUDGE_ERROR)` for every sample of its batch.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Protocol

from tether.chat import Messages
from tether.envs.scoring import RewardInput
from tether.errors import ConfigError, InfraError, InfraReason


class ConversationScorer(Protocol):
    """Scores in [0, 1], one per conversation (messages in the OpenAI form, the answer last)."""

    name: str

    def score(self, conversations: Sequence[Messages]) -> list[float]: ...


def conversation_of(inp: RewardInput) -> Messages:
    """The episode's messages (tool turns included), or the task's prompt and the bare completion."""
    if inp.state is not None:
        return list(inp.state.messages)
    return [*inp.task.messages, {"role": "assistant", "content": inp.completion}]


class RewardModelReward:
    """A reward function (`RewardFn`) scoring each answer's conversation with `scorer`, batched."""

    def __init__(self, scorer: ConversationScorer, max_batch: int = 16) -> None:
        if max_batch < 1:
            raise ConfigError(f"reward model max_batch = {max_batch!r}: expected an integer >= 1")
        self.scorer = scorer
        self.max_batch = max_batch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queued: list[tuple[Messages, asyncio.Future[float]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def __call__(self, inp: RewardInput) -> float:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # futures and the flusher belong to the loop that made them
            self._loop, self._queued, self._flusher = loop, [], None
        future: asyncio.Future[float] = loop.create_future()
        self._queued.append((conversation_of(inp), future))
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # the other rollouts of this batch queue theirs first
        while self._queued:
            batch, self._queued = self._queued[: self.max_batch], self._queued[self.max_batch :]
            conversations = [conversation for conversation, _ in batch]
            try:
                scores = await asyncio.to_thread(self.scorer.score, conversations)
                checked = self._checked(scores, len(batch))
            except Exception as error:  # whatever the model failed on, it is not the policy's answer
                failure = error if isinstance(error, InfraError) else self._failure(error)
                for _, future in batch:  # each its own exception: a raised one collects its traceback
                    if not future.done():
                        future.set_exception(InfraError(failure.reason, str(failure)))
                continue
            for (_, future), value in zip(batch, checked, strict=True):
                if not future.done():  # its waiter may have been cancelled
                    future.set_result(value)

    def _checked(self, scores: Sequence[float], expected: int) -> list[float]:
        if len(scores) != expected:
            raise InfraError(
                InfraReason.JUDGE_ERROR,
                f"reward model {self.scorer.name}: {len(scores)} scores for {expected} conversations",
            )
        bad = [value for value in scores if not (math.isfinite(value) and 0.0 <= value <= 1.0)]
        if bad:
            raise InfraError(
                InfraReason.JUDGE_ERROR,
                f"reward model {self.scorer.name}: scores {bad[:5]} outside [0, 1] (or not finite)",
            )
        return [float(value) for value in scores]

    def _failure(self, error: Exception) -> InfraError:
        return InfraError(
            InfraReason.JUDGE_ERROR, f"reward model {self.scorer.name}: {type(error).__name__}: {error}"
        )
