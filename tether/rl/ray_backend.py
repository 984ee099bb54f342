"""The Ray backend: the learner (`run.backend = "ray"`) and/or the rollout workers (`rollout.backend =
"ray"`) run as Ray actors; the loop stays on the driver.

The driver runs the same `Trainer` loop as local mode (planning, advantages, metrics, async pipelining,
the run directory, checkpoints and resume); only where rollouts are made and where updates run differ.
A learner in the driver's process pushes to worker actors; a learner actor may push to a server fleet.
Each rollout worker owns an `LLMEngine` with its own copy of the policy and scores with the environments
(and its own sandbox pool); the learner actor owns the model and optimizer (`ray_actors.py`). All share one
placement group sized from `[ray]`. After each update the learner's weights reach every worker tagged with
the policy version, so recorded versions and the `max_staleness` bound hold across processes: by a
broadcast over a torch.distributed group from wherever the learner is (`ray_sync.py`, the default), or
with `rollout.weight_sync = "object_store"` once into Ray's object store, every worker pulling them.
The driver keeps a CPU copy of the learner's state that is refreshed only to write a checkpoint (and
sent out after a resume); a sharded learner (one actor per rank, `ray_ranks.py`) writes its own. Ray
is imported only by this backend (`ray_actors.require_ray`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from tether.engine.weight_sync import SyncBackend
from tether.envs.context import ScoringContext
from tether.errors import ConfigError
from tether.models import load
from tether.models.memory_plan import Strategy
from tether.models.transformer import CausalLM
from tether.rl.builders import learner_options, open_learner, open_run
from tether.rl.checkpoint import latest_checkpoint, load_checkpoint
from tether.rl.config import TrainConfig
from tether.rl.learner import Learner, LearnStats
from tether.rl.ray_actors import (
    LearnerActor,
    LearnerState,
    RolloutWorker,
    Weights,
    require_ray,
)
from tether.rl.ray_plan import merge_shards, plan_bundles, shard_plans
from tether.rl.ray_sync import CollectiveSync
from tether.rl.remote_rollouts import server_rollouts
from tether.rl.rollout import PromptPlan
from tether.rl.samples import Sample
from tether.rl.sections import Backend, RaySection, RolloutBackend, WeightSync
from tether.rl.sources import Generated, RolloutSource
from tether.rl.trainer import Trainer, sampling_params

if TYPE_CHECKING:
    from tether.envs.context import SandboxProvider
    from tether.envs.registry import EnvRegistry

# --- the driver's side ------------------------------------------------------------------------------


class RemoteWeights(Iterator[tuple[str, torch.Tensor]]):
    """The learner actor's weights as they are when first used (at once: the driver pushes or snapshots
    them before the next step).

    Over a collective the actor broadcasts them itself; for the object store they are copied there on
    first use of `ref` and rollout workers pull them (`RayRollouts.load`); iterating fetches the tensors
    to the driver, which only async mode's weight snapshots need."""

    def __init__(self, ray: ModuleType, actor: Any) -> None:
        self.ray = ray
        self.actor = actor
        self._ref: Any = None
        self._items: Iterator[tuple[str, torch.Tensor]] | None = None

    @property
    def ref(self) -> Any:
        if self._ref is None:
            self._ref = self.actor.weights.remote()
        return self._ref

    @property
    def copied(self) -> bool:
        """Whether they were copied out of the actor (into the object store)."""
        return self._ref is not None

    def __next__(self) -> tuple[str, torch.Tensor]:
        if self._items is None:
            weights: Weights = self.ray.get(self.ref)
            self._items = iter(weights.items())
        return next(self._items)


class RemoteLearner(Learner):
    """The driver's handle on the learner actor; the inherited model, optimizer and schedule are a CPU
    copy that only holds state for checkpoints (`pull` before writing one, `send` after loading one)."""

    copies_state = True  # checkpoints go through the CPU copy (`pull`, `send`); a sharded one's do not

    def __init__(self, ray: ModuleType, actor: Any, config: TrainConfig, model: CausalLM) -> None:
        super().__init__(model, **learner_options(config))  # LoRA too: the actor's trainable structure
        self.ray = ray
        self.actor = actor

    def step(self, samples: Sequence[Sample]) -> LearnStats:
        stats: LearnStats = self.ray.get(self.actor.step.remote(list(samples)))
        return stats

    def weights(self) -> RemoteWeights:
        return RemoteWeights(self.ray, self.actor)

    def pull(self) -> None:
        state: LearnerState = self.ray.get(self.actor.state.remote())
        self.trainable.load_state_dict(state.model)
        self.optimizer.load_state_dict(state.optimizer)
        self.scheduler.load_state_dict(state.scheduler)

    def send(self) -> None:
        state = LearnerState(
            self.trainable.state_dict(), self.optimizer.state_dict(), self.scheduler.state_dict()
        )
        self.ray.get(self.actor.load_state.remote(state))


class RayRollouts:
    """A `RolloutSource` over rollout worker actors: each generates and scores a shard of the prompts."""

    def __init__(
        self, ray: ModuleType, workers: Sequence[Any], collective: CollectiveSync | None = None
    ) -> None:
        self.ray = ray
        self.workers = list(workers)
        self.collective = collective  # None: weights travel through the object store
        self._version = 0  # the version every worker holds (they start with the model's own, 0)

    def generate(self, plans: Sequence[PromptPlan]) -> Generated:
        shards = shard_plans(plans, len(self.workers))
        busy = [(worker, shard) for worker, shard in zip(self.workers, shards, strict=True) if shard]
        outputs: list[Generated] = self.ray.get([worker.generate.remote(shard) for worker, shard in busy])
        return merge_shards(plans, outputs)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Broadcast from where the weights are (the learner actor's own, or this process's), or one copy
        into the object store (the learner actor's own when they come from it) that every worker pulls."""
        if version == self._version:
            return  # a version's weights never change (version 0: the engines loaded them themselves)
        if self.collective is not None:
            self.collective.push(None if isinstance(weights, RemoteWeights) else weights, version)
        else:
            ref = weights.ref if isinstance(weights, RemoteWeights) else self.ray.put(dict(weights))
            self.ray.get([worker.load.remote(ref, version) for worker in self.workers])
        self._version = version

    def versions(self) -> list[int]:
        """The policy version each worker's engine holds."""
        versions: list[int] = self.ray.get([worker.version.remote() for worker in self.workers])
        return versions

    def close(self) -> None:
        try:
            if self.collective is not None:
                self.collective.close()
        finally:
            self.ray.get([worker.close.remote() for worker in self.workers])


class RayCluster:
    """The run's placement group and actors, and the cluster itself when this process started it."""

    def __init__(self, ray: ModuleType, config: TrainConfig) -> None:
        self.ray = ray
        self.started = not ray.is_initialized()
        section = config.ray
        # How many learner actors (one per rank; none: the learner is in this process).
        self.learners = config.learner.world_size if config.run.backend is Backend.RAY else 0
        self.workers = config.rollout_backend is RolloutBackend.RAY  # whether the rollout engines are
        plan = plan_bundles(config.run.name, section, self.learners, self.workers)
        if self.started:
            self._init(section, math.ceil(sum(b["CPU"] for b in plan.bundles)))
        self.actors: list[Any] = []
        self.group = ray.util.placement_group(list(plan.bundles), strategy=plan.strategy, name=plan.name)
        ready, _ = ray.wait([self.group.ready()], timeout=section.placement_timeout_s)
        if not ready:
            available = ray.available_resources()
            self.close()
            raise ConfigError(
                f"the Ray cluster cannot place this run's actors within {section.placement_timeout_s:g} s: "
                f"[ray] asks for bundles {list(plan.bundles)}, the cluster has {available} free; "
                "lower ray.learner_cpus, ray.rollout_cpus or ray.rollout_workers, or add nodes"
            )

    def _init(self, section: RaySection, cpus: int) -> None:
        # A cluster started here gets just the CPUs the actors ask for; GPUs are detected. Actor logs
        # stay in Ray's log files (the live view owns the terminal); failures still arrive as exceptions.
        options: dict[str, Any] = (
            {"address": section.address}
            if section.address
            else {"num_cpus": cpus, "object_store_memory": section.object_store_mib * 2**20}
        )
        try:
            self.ray.init(**options, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as error:
            raise ConfigError(
                f"ray.address = {section.address!r}: cannot start or join a Ray cluster: {error}"
            ) from None

    def actor(
        self, cls: type, bundle: int, cpus: float, gpus: float, *args: Any, concurrency: int = 1
    ) -> Any:
        """An actor of `cls` in `bundle`, running up to `concurrency` of its calls at once (threads)."""
        strategy = self.ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=bundle
        )
        remote = self.ray.remote(cls).options(
            num_cpus=cpus, num_gpus=gpus, scheduling_strategy=strategy, max_concurrency=concurrency
        )
        handle = remote.remote(*args)
        self.actors.append(handle)
        return handle

    def close(self) -> None:
        for handle in self.actors:
            self.ray.kill(handle)
        self.actors.clear()
        self.ray.util.remove_placement_group(self.group)
        if self.started:
            self.ray.shutdown()


class RayTrainer(Trainer):
    """The local loop with Ray rollouts and/or a remote learner (whose state checkpoints pull); it owns
    the cluster."""

    def __init__(
        self,
        config: TrainConfig,
        learner: Learner,
        rollouts: RolloutSource,
        registry: EnvRegistry,
        cluster: RayCluster,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config, None, None, learner, registry, ScoringContext(), clock, rollouts=rollouts)
        self.remote = learner if isinstance(learner, RemoteLearner) else None
        self.cluster = cluster

    def start_run_dir(self, resume: bool) -> None:
        if resume and self.remote is not None and self.remote.copies_state:
            # The actor must hold the checkpoint's state before the local resume pushes its weights to
            # the workers; the local resume then loads the same checkpoint into the driver's copy again.
            learner = self.learner
            load_checkpoint(latest_checkpoint(self.run_dir), learner)
            self.remote.send()
        super().start_run_dir(resume)

    def checkpoint(self) -> Path:
        if self.remote is not None and self.remote.copies_state:
            self.remote.pull()
        return super().checkpoint()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.cluster.close()


def build_ray_trainer(
    config: TrainConfig,
    registry: EnvRegistry,
    sandbox: SandboxProvider | None = None,
    resume: bool = False,
) -> RayTrainer:
    """Start (or join) Ray, place the learner and/or the rollout workers, and open the run directory.

    Each worker gets its own copy of the (unstarted) `sandbox` provider and so its own sandbox pool."""
    learner_actor = config.run.backend is Backend.RAY
    if learner_actor and config.learner.strategy is Strategy.FSDP and "WORLD_SIZE" in os.environ:
        raise ConfigError(
            "run.backend = 'ray' with learner.strategy = 'fsdp' starts the learner ranks as Ray actors: "
            "run tether train without torchrun (or set run.backend = 'local' under torchrun)"
        )
    ray = require_ray("run.backend" if learner_actor else "rollout.backend")
    torch.manual_seed(config.run.seed)
    servers = None
    if config.rollout_backend.remote:  # before the cluster: a mixture servers cannot roll out fails here
        servers = server_rollouts(config, registry, ScoringContext(sandbox), sampling_params(config.rollout))
    try:
        cluster = RayCluster(ray, config)
    except BaseException:
        if servers is not None:
            servers.close()
        raise
    try:
        section = config.ray
        learner: Learner
        if learner_actor:
            # Over a collective, async mode's rollout thread has the actor broadcast a snapshot while the
            # learner thread has it take a step: a second call thread, or the engines' wait for the
            # broadcast would last as long as a step. Only that pair ever overlaps (the snapshot is the
            # driver's copy, never the weights being trained).
            threaded = config.weight_sync is WeightSync.COLLECTIVE and not config.rollout_backend.remote
            model, _, _ = load(config.model.name, config.model.cache_dir, device="cpu")
            if config.learner.strategy is Strategy.FSDP:
                from tether.rl.ray_ranks import RemoteShardedLearner, start_ranks

                actor, following = start_ranks(ray, cluster, config, 2 if threaded else 1)
                learner = RemoteShardedLearner(ray, actor, config, model, following)
            else:
                actor = cluster.actor(
                    LearnerActor,
                    0,
                    section.learner_cpus,
                    section.learner_gpus,
                    config,
                    section.learner_cpus,
                    concurrency=2 if threaded else 1,
                )
                learner = RemoteLearner(ray, actor, config, model)
        else:
            learner = open_learner(config)
        rollouts: RolloutSource
        if servers is None:
            workers = [
                cluster.actor(
                    RolloutWorker,
                    cluster.learners + index,  # after the learners' bundles, if they have any
                    section.rollout_cpus,
                    section.rollout_gpus,
                    config,
                    registry,
                    sandbox,
                    section.rollout_cpus,
                )
                for index in range(section.rollout_workers)
            ]
            # Wait for every actor's model, so that a failing one stops the run here and step 1's
            # timings measure the step, not the actors' start.
            ray.get([worker.version.remote() for worker in workers])
            collective = None
            if config.weight_sync is WeightSync.COLLECTIVE:
                cuda = config.model.device.startswith("cuda")
                backend = SyncBackend.NCCL if cuda else SyncBackend.GLOO
                collective = CollectiveSync.start(ray, workers, actor if learner_actor else None, backend)
            rollouts = RayRollouts(ray, workers, collective)
        else:
            rollouts = servers
        if learner_actor:
            ray.get(actor.device.remote())
        trainer = RayTrainer(config, learner, rollouts, registry, cluster)
    except BaseException:
        try:
            if servers is not None:
                servers.close()
        finally:
            cluster.close()
        raise
    return open_run(trainer, resume)
