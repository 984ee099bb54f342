"""Rollouts from a fleet of vLLM or SGLang servers (`servers.py`): the `RemoteRollouts` source and
`server_rollouts`, which builds it from `[rollout]`. Prompts are single-turn only: multi-turn episodes need
our engine (`episodes.py`), so a fleet refuses them."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from tether.chat.template import ChatTemplate
from tether.engine.sampling import SamplingParams
from tether.engine.weight_sync import SyncBackend
from tether.envs.context import ScoringContext
from tether.envs.registry import EnvRegistry, mixture_from_weights
from tether.errors import ConfigError, InfraReason
from tether.rl.config import TrainConfig
from tether.rl.fleet import FleetHealth, Served, Spread, Unserved, spread
from tether.rl.retries import RetryPolicy
from tether.rl.rollout import PromptPlan, Rollout, encode_prompt, score_groups
from tether.rl.sections import WeightSync
from tether.rl.server_errors import ServerError, server_failed
from tether.rl.server_weights import CollectiveTransport, SafetensorsDirTransport
from tether.rl.servers import SERVERS, RolloutServer, ServerConfig, ServerSample, Tensors
from tether.rl.sources import Generated

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True)
class Failover:
    """How a fleet copes with servers that fail (`[rollout] server_attempts` and `server_probe_s`)."""

    attempts: int = 3
    """Most times one prompt is sent, on different servers; then its samples are infra-failed."""
    probe_s: float = 30.0
    """Wait before a removed server is probed again, doubled after each failed probe."""


class RemoteRollouts:
    """Rollouts from a fleet of rollout servers, scored in this process on one event loop.

    A step's prompts go to the servers in rotation in turn, all at once (each server batches what it
    gets), one request of n samples per prompt with the plan's seed; the servers' token ids, logprobs and
    versions are kept as they come. A version's weights travel once (`transport`, in `dtype`: a
    safetensors folder or a broadcast) and every server in rotation loads them; then the folder transport
    deletes the older versions' folders (a server that returns loads the current one).

    Failover (`fleet.py`): before a step every server in rotation answers a health check, and removed
    servers whose wait is over are probed and rejoin once they have loaded the current version. A server
    that fails a health check, a request (refused, reset, timed out, 5xx) or a weight update is removed;
    its unfinished prompts go, with the same seeds, to the servers left, each at most
    `failover.attempts` times; a prompt still unserved comes back as infra-failed rollouts
    (`engine_failure`, no completion). With no server left the step fails naming each server's error.
    Re-issued samples carry `engine_failure` in their `retry_reasons` (counted as
    `rollout/retried/engine_failure`). Counters: `rollout/servers_removed` (since the
    last step), `rollout/servers_healthy` (in rotation after the step)."""

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
        failover: Failover = Failover(),
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        assert servers, "a fleet of at least one server"
        self.retry = retry  # scoring's: re-scoring after a sandbox or scorer failure
        self.servers = list(servers)
        self.transport = transport
        self.tokenizer = tokenizer
        self.template = ChatTemplate(tokenizer)
        self.registry = registry
        self.ctx = ctx
        self.params = params
        self.dtype = dtype
        self.clock = clock
        self.failover = failover
        self.fleet = FleetHealth([server.url for server in self.servers], failover.probe_s, clock)
        # The version the fleet serves and its tensors' names, dtypes and shapes (on the meta device: no
        # memory), which a returning server needs to load it. Empty: the servers' own starting weights.
        self._version = max(server.policy_version for server in self.servers)
        self._manifest: Tensors = []
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
        spread = self._loop.run_until_complete(self._generate(plans, prompts))
        rollouts = [
            rollout
            for plan, prompt, outcome in zip(plans, prompts, spread.outcomes, strict=True)
            for rollout in self._rollouts(plan, prompt, outcome)
        ]
        generated = self.clock()
        served = [rollout for rollout in rollouts if rollout.infra_failure is None]
        self._loop.run_until_complete(score_groups(self.registry, tasks, served, self.ctx, self.retry))
        scored = self.clock()
        counters = {
            **self.ctx.take_counters(),
            "rollout/servers_removed": float(self.fleet.take_removals()),
            "rollout/servers_healthy": float(len(self.fleet.in_rotation())),
        }
        return Generated(tasks, rollouts, generated - start, scored - generated, counters)

    def _rollouts(
        self, plan: PromptPlan, prompt: list[int], outcome: Served[list[ServerSample]] | Unserved
    ) -> list[Rollout]:
        if isinstance(outcome, Unserved):
            error = f"no server served it in {outcome.attempts} attempts: {outcome.error}"
            return [
                Rollout(
                    plan.env,
                    plan.seed,
                    plan.group,
                    list(prompt),
                    [],
                    [],
                    [],
                    "abort",
                    error=error,
                    infra_failure=InfraReason.ENGINE_FAILURE.value,
                    retry_reasons=[InfraReason.ENGINE_FAILURE.value] * (outcome.attempts - 1),
                )
                for _ in range(self.params.n)
            ]
        return [
            Rollout(
                plan.env,
                plan.seed,
                plan.group,
                list(prompt),
                list(sample.token_ids),
                list(sample.logprobs),
                list(sample.versions),
                sample.finish_reason,
                text=str(self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)),
                retry_reasons=[InfraReason.ENGINE_FAILURE.value] * (outcome.attempts - 1),
            )
            for sample in outcome.value
        ]

    async def _generate(
        self, plans: Sequence[PromptPlan], prompts: Sequence[list[int]]
    ) -> Spread[list[ServerSample]]:
        await self._check_health()

        def send(index: int, server: int) -> Awaitable[list[ServerSample]]:
            params = replace(self.params, seed=plans[index].sample_seed)
            return self.servers[server].generate(prompts[index], params)

        return await spread(len(prompts), self.fleet, send, self.failover.attempts, server_failed)

    async def _check_health(self) -> None:
        """Servers in rotation that fail a health check leave it; removed ones due for a probe that pass
        it and load the current version rejoin."""
        rotation, due = self.fleet.in_rotation(), self.fleet.due_for_probe()
        checks = await asyncio.gather(
            *(self.servers[i].health() for i in rotation),
            *(self._probe(self.servers[i]) for i in due),
            return_exceptions=True,
        )
        for index, outcome in zip(rotation, checks[: len(rotation)], strict=True):
            if isinstance(outcome, ServerError):
                self.fleet.remove(index, f"health check: {outcome}")
            elif isinstance(outcome, BaseException):
                raise outcome
        for index, outcome in zip(due, checks[len(rotation) :], strict=True):
            if isinstance(outcome, ServerError):
                self.fleet.probe_failed(index, f"probe: {outcome}")
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                self.fleet.rejoin(index)

    async def _probe(self, server: RolloutServer) -> None:
        await server.health()
        if self._manifest:  # it may have restarted with its starting weights, or missed updates
            await self.transport.reload(server, self._manifest, self._version)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        rotation = self.fleet.in_rotation()
        behind = [i for i in rotation if self.servers[i].policy_version < version]
        if not behind and version <= self._version:
            return  # a version's weights never change (version 0: the servers started with them)
        tensors = [(name, tensor.detach().to(device="cpu", dtype=self.dtype)) for name, tensor in weights]
        servers = [self.servers[i] for i in behind]
        failures = self._loop.run_until_complete(self.transport.deliver(servers, tensors, version))
        for index, failure in zip(behind, failures, strict=True):
            if isinstance(failure, ServerError):
                self.fleet.remove(index, f"weight update to version {version}: {failure}")
            elif failure is not None:
                raise failure  # not the server's doing: no other server would fare better
        self._version = version
        self._manifest = [(name, torch.empty_like(tensor, device="meta")) for name, tensor in tensors]
        # Every server in rotation holds it; a removed one loads it (not an older one) to come back.
        self.transport.keep_only(version)

    def close(self) -> None:
        """Close the servers' clients, what scoring opened (a judge's client), the sandbox pool (if scoring
        started one) and the loop."""
        for server in self.servers:
            self._loop.run_until_complete(server.aclose())
        self._loop.run_until_complete(self.ctx.aclose())
        self._loop.close()


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
        SERVERS[backend](
            ServerConfig(
                url,
                model=name,
                timeout_s=section.timeout_s,
                health_timeout_s=section.health_timeout_s,
                api_key=api_key,
            )
        )
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
    failover = Failover(section.server_attempts, section.server_probe_s)
    return RemoteRollouts(
        servers,
        transport,
        tokenizer,
        registry,
        ctx,
        params,
        config.model.dtype.torch,
        failover=failover,
        retry=RetryPolicy.of(config.rollout),
    )
