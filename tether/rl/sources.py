"""Where a step's rollouts come from: the `RolloutSource` seam (`[rollout] backend`) and its implementations.

A source generates and scores planned prompts with the weights it last loaded and tags every token with
the policy version that produced it; `load(weights, version)` is its one way in for weights.
`EngineRollouts` runs our `LLMEngine` in this process, `RemoteRollouts` a fleet of vLLM or SGLang
servers (`remote_rollouts.py`), and the Ray backend (`ray_backend.py`) our engines as actors. Every source
scores with the same `score_groups`; multi-turn episodes need our engine (`episodes.py`; agent tasks:
`agent_rollouts.py`), so servers refuse them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from tether.engine.sampling import SamplingParams
from tether.envs.context import ScoringContext
from tether.envs.registry import EnvRegistry
from tether.envs.tasks import Task
from tether.rl.agent_rollouts import AgentRollouts, is_agent_env
from tether.rl.episodes import EpisodeDriver, ReplyParser
from tether.rl.retries import RetryPolicy
from tether.rl.rollout import PromptPlan, Rollout, generate_groups, score_groups

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tether.engine.llm_engine import LLMEngine


@dataclass(frozen=True, slots=True)
class Generated:
    """A step's planned prompts, generated and scored by a `RolloutSource`."""

    tasks: list[Task]
    rollouts: list[Rollout]  # `samples_per_prompt` per plan, in plan order
    generate_s: float
    score_s: float
    # Events of the source during the step, added to the step's metrics as they are (e.g.
    # `rollout/workers_replaced`, and what scoring counted in its context: `judge/requests`...); counts of
    # the same name from several shards are summed.
    counters: dict[str, float] = field(default_factory=dict)


class RolloutSource(Protocol):
    """Where rollouts come from: `EngineRollouts`, `RemoteRollouts` or Ray workers (`ray_backend.py`)."""

    def generate(self, plans: Sequence[PromptPlan]) -> Generated:
        """Generate and score the planned prompts with the weights last loaded."""
        ...

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Generate with `weights` from now on; their tokens are recorded as policy `version`."""
        ...

    def close(self) -> None: ...


class EngineRollouts:
    """Rollouts from an engine in this process, scored on one event loop (the sandbox pool lives on it)."""

    def __init__(
        self,
        engine: LLMEngine,
        tokenizer: PreTrainedTokenizerBase,
        registry: EnvRegistry,
        ctx: ScoringContext,
        params: SamplingParams,
        clock: Callable[[], float] = time.monotonic,
        parse_reply: ReplyParser | None = None,
        agent_state_dir: Path | None = None,
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        self.engine = engine
        self.retry = retry  # of rollouts that fail for an infrastructure reason (`retries.py`)
        self.tokenizer = tokenizer
        self.registry = registry
        self.ctx = ctx
        self.params = params
        self.clock = clock
        # Multi-turn: reply text -> assistant message (None: the chat template's tool-call format).
        self.parse_reply = parse_reply
        # Agent tasks: where their journal lives between batches (None: a temporary one per batch).
        self.agent_state_dir = agent_state_dir
        # Decode steps of few sequences computed as the learner computes whole sequences: equal logprobs.
        engine.set_batch_invariant(True)
        # One loop for the whole run: the sandbox pool started by scoring lives on it between steps.
        self._loop = asyncio.new_event_loop()

    def generate(self, plans: Sequence[PromptPlan]) -> Generated:
        start = self.clock()
        if any(is_agent_env(plan.env) for plan in plans):
            agents = AgentRollouts(
                self.engine, self.tokenizer, self.params, self.agent_state_dir, retry=self.retry
            )
            tasks, rollouts = self._loop.run_until_complete(agents.run(plans, self.registry, self.ctx))
            return Generated(tasks, rollouts, self.clock() - start, 0.0, self.ctx.take_counters())
        if any(self.registry.get(plan.env).multi_turn for plan in plans):
            # Episodes are scored as they end, while the engine keeps generating for the others.
            driver = EpisodeDriver(
                self.engine, self.tokenizer, self.registry, self.params, self.parse_reply, self.retry
            )
            tasks, rollouts = self._loop.run_until_complete(driver.run(plans, self.ctx))
            return Generated(tasks, rollouts, self.clock() - start, 0.0, self.ctx.take_counters())
        tasks, rollouts = generate_groups(self.engine, self.tokenizer, self.registry, plans, self.params)
        generated = self.clock()
        self._loop.run_until_complete(score_groups(self.registry, tasks, rollouts, self.ctx, self.retry))
        scored = self.clock()
        return Generated(tasks, rollouts, generated - start, scored - generated, self.ctx.take_counters())

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if version == self.engine.latest_version:
            return  # a version's weights never change (version 0: the engine loaded them itself)
        # The engine applies the update under its policy (by default once in-flight requests finish),
        # so every token stays tagged with the version that really produced it.
        self.engine.update_weights(weights, version=version)

    def close(self) -> None:
        """Close what scoring opened (a judge's client), the sandbox pool (if scoring started one) and the
        event loop."""
        self._loop.run_until_complete(self.ctx.aclose())
        self._loop.close()
