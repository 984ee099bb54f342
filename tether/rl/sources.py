"""Where a step's rollouts come from: the `RolloutSource` seam (`[rollout] backend`) and its implementations.

A source generates and scores planned prompts with the weights it last loaded and tags every token with
the policy version that produced it; `load(weights, version)` is its one way in for weights.
`EngineRollouts` runs our `LLMEngine` in this process, `RemoteRollouts` a fleet of vLLM or SGLang servers
(`servers.py`), and the Ray backend (`ray_backend.py`) our engines as actors. Every source scores with
the same `score_groups`; multi-turn episodes need our engine (`episodes.py`; agent tasks:
`agent_rollouts.py`), so servers refuse them.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from tether.chat.template import ChatTemplate
from tether.engine.sampling import SamplingParams
from tether.engine.weight_sync import SyncBackend
from tether.envs.context import ScoringContext
from tether.envs.registry import EnvRegistry, mixture_from_weights
from tether.envs.tasks import Task
from tether.errors import ConfigError
from tether.rl.agent_rollouts import AgentRollouts, is_agent_env
from tether.rl.config import TrainConfig
from tether.rl.episodes import EpisodeDriver, ReplyParser
from tether.rl.rollout import PromptPlan, Rollout, encode_prompt, generate_groups, score_groups
from tether.rl.sections import WeightSync
from tether.rl.server_weights import CollectiveTransport, SafetensorsDirTransport
from tether.rl.servers import (
    SERVERS,
    RolloutServer,
    ServerConfig,
    ServerSample,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tether.engine.llm_engine import LLMEngine


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Generated:
    """A step's planned prompts, generated and scored by a `RolloutSource`."""

    tasks: list[Task]
    rollouts: list[Rollout]  # `samples_per_prompt` per plan, in plan order
    generate_s: float
    score_s: float
    # Events of the source during the step, added to the step's metrics as they are (e.g.
    # `rollout/workers_replaced`); counts of the same name from several shards are summed.
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
    ) -> None:
        self.engine = engine
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
            agents = AgentRollouts(self.engine, self.tokenizer, self.params, self.agent_state_dir)
            tasks, rollouts = self._loop.run_until_complete(agents.run(plans, self.registry, self.ctx))
            return Generated(tasks, rollouts, self.clock() - start, 0.0)
        if any(self.registry.get(plan.env).multi_turn for plan in plans):
            # Episodes are scored as they end, while the engine keeps generating for the others.
            driver = EpisodeDriver(self.engine, self.tokenizer, self.registry, self.params, self.parse_reply)
            tasks, rollouts = self._loop.run_until_complete(driver.run(plans, self.ctx))
            return Generated(tasks, rollouts, self.clock() - start, 0.0)
        tasks, rollouts = generate_groups(self.engine, self.tokenizer, self.registry, plans, self.params)
        generated = self.clock()
        self._loop.run_until_complete(score_groups(self.registry, tasks, rollouts, self.ctx))
        return Generated(tasks, rollouts, generated - start, self.clock() - generated)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if version == self.engine.latest_version:
            return  # a version's weights never change (version 0: the engine loaded them itself)
        # The engine applies the update under its policy (by default once in-flight requests finish),
        # so every token stays tagged with the version that really produced it.
        self.engine.update_weights(weights, version=version)

    def close(self) -> None:
        """Stop the sandbox pool (if scoring started one) and the event loop."""
        if self.ctx.sandbox is not None:
            self._loop.run_until_complete(self.ctx.sandbox.aclose())
        self._loop.close()


class RemoteRollouts:
    """Rollouts from a fleet of rollout servers, scored in this process on one event loop.

    A step's prompts go to the servers in turn, all at once (each server batches what it gets), one
    request of n samples per prompt with the plan's seed; the servers' token ids, logprobs and versions
    are kept as they come. A version's weights travel once (`transport`, in `dtype`: a safetensors folder
    or a broadcast) and every server loads them; once all have, the folder transport deletes the older
    versions' folders."""

    def __init__(
        self,
        servers: Sequence[RolloutServer],
        transport: SafetensorsDirTransport | CollectiveTransport,
        tokenizer: PreTrainedTokenizerBase,
        registry: EnvRegistry,
        ctx: ScoringContext,
        params: SamplingParams,
        dtype: torch.dtype = torch.float32,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert servers, "a fleet of at least one server"
        self.servers = list(servers)
        self.transport = transport
        self.tokenizer = tokenizer
        self.template = ChatTemplate(tokenizer)
        self.registry = registry
        self.ctx = ctx
        self.params = params
        self.dtype = dtype
        self.clock = clock
        self._loop = asyncio.new_event_loop()  # the servers' HTTP clients and the sandbox pool live on it

    def generate(self, plans: Sequence[PromptPlan]) -> Generated:
        start = self.clock()
        tasks = []
        for plan in plans:
            env = self.registry.get(plan.env)
            if env.multi_turn:
                raise ConfigError(f"{plan.env!r} is multi-turn: {_MULTI_TURN}")
            tasks.append(env.task(plan.seed))
        prompts = [encode_prompt(self.template, task) for task in tasks]
        answers = self._loop.run_until_complete(self._generate(plans, prompts))
        rollouts = [
            Rollout(
                env=plan.env,
                seed=plan.seed,
                group=plan.group,
                prompt_ids=list(prompt),
                completion_ids=list(sample.token_ids),
                logprobs=list(sample.logprobs),
                versions=list(sample.versions),
                finish_reason=sample.finish_reason,
                text=str(self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)),
                # Billed as our engine would be: the prompt once per plan, on its first sample.
                billed_prompt_tokens=len(prompt) if index == 0 else 0,
                cached_prompt_tokens=min(sample.cached_tokens, len(prompt)) if index == 0 else 0,
            )
            for plan, prompt, samples in zip(plans, prompts, answers, strict=True)
            for index, sample in enumerate(samples)
        ]
        generated = self.clock()
        self._loop.run_until_complete(score_groups(self.registry, tasks, rollouts, self.ctx))
        return Generated(tasks, rollouts, generated - start, self.clock() - generated)

    async def _generate(
        self, plans: Sequence[PromptPlan], prompts: Sequence[list[int]]
    ) -> list[list[ServerSample]]:
        return await _all(
            self.servers[index % len(self.servers)].generate(
                prompt, replace(self.params, seed=plan.sample_seed)
            )
            for index, (plan, prompt) in enumerate(zip(plans, prompts, strict=True))
        )

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        behind = [server for server in self.servers if server.policy_version < version]
        if not behind:
            return  # a version's weights never change (version 0: the servers started with them)
        tensors = [(name, tensor.detach().to(device="cpu", dtype=self.dtype)) for name, tensor in weights]

        self._loop.run_until_complete(self.transport.deliver(behind, tensors, version))
        self.transport.keep_only(version)  # only after every server holds it: a failed load may retry

    def close(self) -> None:
        """Close the servers' clients and stop the sandbox pool (if scoring started one) and the loop."""
        for server in self.servers:
            self._loop.run_until_complete(server.aclose())
        if self.ctx.sandbox is not None:
            self._loop.run_until_complete(self.ctx.sandbox.aclose())
        self._loop.close()


async def _all(calls: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """The calls' results, run concurrently; the first failure cancels the rest (instead of leaving them
    running on the loop) and is raised as it is, not wrapped in an exception group. For requests only:
    a cancelled weight update would leave its server's weights unknown."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(call) for call in calls]
    except ExceptionGroup as failures:
        raise failures.exceptions[0] from None
    return [task.result() for task in tasks]


_MULTI_TURN = (
    "its episodes run on our engine (tether/rl/episodes.py), not on vLLM or SGLang servers; use "
    "rollout.backend = 'local' or 'ray' for it"
)


def server_rollouts(
    config: TrainConfig, registry: EnvRegistry, ctx: ScoringContext, params: SamplingParams
) -> RemoteRollouts:
    """The fleet `[rollout]` names; multi-turn environments in the mixture fail here, before any loading."""
    from tether.models.loader import load_tokenizer, resolve

    backend, section = config.rollout_backend, config.rollout
    assert backend.remote, f"rollout.backend = {backend!r} is not a server fleet"
    mixture = mixture_from_weights(registry, config.envs.weights)
    multi = [name for name in mixture.names if registry.get(name).multi_turn]
    if multi:
        raise ConfigError(
            f"rollout.backend = {str(backend)!r} with multi-turn environments {multi}: {_MULTI_TURN}"
        )
    api_key = None
    if section.api_key_env is not None:
        api_key = os.environ.get(section.api_key_env)
        if not api_key:
            raise ConfigError(
                f"rollout.api_key_env = {section.api_key_env!r}: that environment variable is not set; "
                "export it with the servers' API key, or unset rollout.api_key_env"
            )
    name = section.served_model or config.model.name
    servers = [
        SERVERS[backend](ServerConfig(url, model=name, timeout_s=section.timeout_s, api_key=api_key))
        for url in section.base_urls
    ]
    transport: SafetensorsDirTransport | CollectiveTransport
    if config.weight_sync is WeightSync.COLLECTIVE:
        cuda = config.model.device.startswith("cuda")
        sync = SyncBackend.NCCL if cuda else SyncBackend.GLOO
        transport = CollectiveTransport(section.sync_host, sync, section.timeout_s)
    else:
        transport = SafetensorsDirTransport(section.weights_dir or config.run_dir / "weights")
    tokenizer = load_tokenizer(resolve(config.model.name, config.model.cache_dir))
    return RemoteRollouts(servers, transport, tokenizer, registry, ctx, params, config.model.dtype.torch)
