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
sent out after a resume); a sharded learner (one actor per rank, `ray_ranks.py`) writes its own. Every
call to an actor has a deadline (`ray_failover.py`): the fleet replaces a lost rollout worker
(`ray_rollouts.py`), and a lost learner actor makes the run resume from its last checkpoint on new
actors (`RayTrainer.run`; not for a sharded learner or a server fleet, whose loss stops the run). Ray
is imported only by this backend (`ray_actors.require_ray`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
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
from tether.rl.checkpoint import has_checkpoint, latest_checkpoint, load_checkpoint
from tether.rl.cluster_sections import RaySection
from tether.rl.config import TrainConfig
from tether.rl.learner import Learner, LearnStats
from tether.rl.pipeline import WeightStore
from tether.rl.ray_actors import LearnerActor, LearnerState, RolloutWorker, require_ray
from tether.rl.ray_failover import ActorName, LearnerLostError, Whereabouts, answer
from tether.rl.ray_plan import plan_bundles
from tether.rl.ray_rollouts import RayRollouts, RemoteWeights, WorkerSlot
from tether.rl.ray_sync import CollectiveSync
from tether.rl.remote_rollouts import server_rollouts
from tether.rl.samples import Sample
from tether.rl.sections import Backend, RolloutBackend, WeightSync
from tether.rl.sources import RolloutSource
from tether.rl.trainer import Metrics, Produced, Trainer, sampling_params

if TYPE_CHECKING:
    from tether.envs.context import SandboxProvider
    from tether.envs.registry import EnvRegistry

# --- the driver's side ------------------------------------------------------------------------------


class RemoteLearner(Learner):
    """The driver's handle on the learner actor; the inherited model, optimizer and schedule are a CPU
    copy that only holds state for checkpoints (`pull` before writing one, `send` after loading one).
    Each call waits at most `ray.call_timeout_s`; a learner that dies or hangs is a `LearnerLostError`."""

    copies_state = True  # checkpoints go through the CPU copy (`pull`, `send`); a sharded one's do not

    def __init__(
        self,
        ray: ModuleType,
        actor: Any,
        config: TrainConfig,
        model: CausalLM,
        where: Whereabouts | None = None,
    ) -> None:
        super().__init__(model, **learner_options(config))  # LoRA too: the actor's trainable structure
        self.ray = ray
        self.actor = actor
        self.name = ActorName("the learner actor", where)
        self.call_timeout_s = config.ray.call_timeout_s

    def _call(self, ref: Any, method: str) -> Any:
        return answer(self.ray, self.actor, ref, self.name, method, self.call_timeout_s, LearnerLostError)

    def step(self, samples: Sequence[Sample]) -> LearnStats:
        stats: LearnStats = self._call(self.actor.step.remote(list(samples)), "step")
        return stats

    def weights(self) -> RemoteWeights:
        return RemoteWeights(self.ray, self.actor)

    def pull(self) -> None:
        state: LearnerState = self._call(self.actor.state.remote(), "state")
        self.trainable.load_state_dict(state.model)
        self.optimizer.load_state_dict(state.optimizer)
        self.scheduler.load_state_dict(state.scheduler)

    def send(self) -> None:
        state = LearnerState(
            self.trainable.state_dict(), self.optimizer.state_dict(), self.scheduler.state_dict()
        )
        self._call(self.actor.load_state.remote(state), "load_state")


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

    def kill_actors(self) -> None:
        """Kill every actor of the run (their bundles stay reserved for new ones)."""
        for handle in self.actors:
            self.ray.kill(handle)
        self.actors.clear()

    def close(self) -> None:
        self.kill_actors()
        self.ray.util.remove_placement_group(self.group)
        if self.started:
            self.ray.shutdown()


RESUMPTIONS = "run/resumptions"  # the metric: times this run resumed after losing its learner actor

# Starts the run's learner and rollout source on (new) actors in the run's placement group.
StartActors = Callable[[], tuple[Learner, RolloutSource]]


class RayTrainer(Trainer):
    """The local loop with Ray rollouts and/or a remote learner (whose state checkpoints pull); it owns
    the cluster. A learner actor that is lost (`LearnerLostError`) makes the run start new actors and
    resume from its last checkpoint (from the start without one), up to `ray.max_learner_restarts`
    times; `restart` None (a sharded learner, or a server fleet, which cannot go back to an older
    version): the run stops."""

    def __init__(
        self,
        config: TrainConfig,
        learner: Learner,
        rollouts: RolloutSource,
        registry: EnvRegistry,
        cluster: RayCluster,
        restart: StartActors | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config, None, None, learner, registry, ScoringContext(), clock, rollouts=rollouts)
        self.remote = learner if isinstance(learner, RemoteLearner) else None
        self.cluster = cluster
        self.restart = restart
        self.resumptions = 0

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

    def learn(self, produced: Produced) -> tuple[Metrics, bool]:
        metrics, changed = super().learn(produced)
        if self.resumptions:
            metrics[RESUMPTIONS] = float(self.resumptions)
        return metrics, changed

    def run(
        self, on_step: Callable[[Metrics], None] | None = None, final_checkpoint: bool = True
    ) -> list[Metrics]:
        history: list[Metrics] = []

        def seen(metrics: Metrics) -> None:
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)

        while True:
            try:
                super().run(seen, final_checkpoint)
                return history
            except LearnerLostError as error:
                self.resume_after(error)
                history = [metrics for metrics in history if metrics["step"] <= self.step]

    def resume_after(self, error: LearnerLostError) -> None:
        """New actors in the same bundles, the last checkpoint's state in the new learner and its weights
        in the new workers, the step and cursors back to it; or `error` again when no restart is left."""
        limit = self.config.ray.max_learner_restarts
        if self.restart is None:
            raise error
        if self.resumptions >= limit:
            raise LearnerLostError(
                f"{error}; the run already resumed {self.resumptions} time(s) "
                f"(ray.max_learner_restarts = {limit})",
                error.hung,
            ) from error
        self.resumptions += 1
        self.finish_checkpoint()  # written from the driver's copy: it may become the one to resume from
        self.cluster.kill_actors()
        self.learner, self.rollouts = self.restart()
        self.remote = self.learner if isinstance(self.learner, RemoteLearner) else None
        self.weight_store = WeightStore()
        resume = has_checkpoint(self.run_dir)
        if not resume:  # lost before the first checkpoint: the run starts over
            self.step, self.cursors = 0, {}
        self.start_run_dir(resume)

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

        def start() -> tuple[Learner, RolloutSource]:
            return start_actors(ray, cluster, config, registry, sandbox, servers)

        learner, rollouts = start()
        # A sharded learner's ranks fail as a group (`LearnerRankError`) and a server fleet cannot go back
        # to an older version: neither resumes by itself.
        single = learner_actor and config.learner.strategy is Strategy.SINGLE
        restart = start if single and servers is None else None
        trainer = RayTrainer(config, learner, rollouts, registry, cluster, restart)
    except BaseException:
        try:
            if servers is not None:
                servers.close()
        finally:
            cluster.close()
        raise
    return open_run(trainer, resume)


def start_actors(
    ray: ModuleType,
    cluster: RayCluster,
    config: TrainConfig,
    registry: EnvRegistry,
    sandbox: SandboxProvider | None,
    servers: RolloutSource | None,
) -> tuple[Learner, RolloutSource]:
    """The run's learner (an actor, or in this process) and its rollout source (worker actors, or
    `servers`), each actor in its bundle of the cluster's placement group, every one loaded."""
    section = config.ray
    learner_actor = config.run.backend is Backend.RAY
    learner: Learner
    actor: Any = None
    if learner_actor:
        # Over a collective, async mode's rollout thread has the actor broadcast a snapshot while the
        # learner thread has it take a step: a second call thread, or the engines' wait for the
        # broadcast would last as long as a step. Only that pair ever overlaps (the snapshot is the
        # driver's copy, never the weights being trained).
        threaded = config.weight_sync is WeightSync.COLLECTIVE and servers is None
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
            learner = RemoteLearner(ray, actor, config, model, ray.get(actor.whereabouts.remote()))
    else:
        learner = open_learner(config)
    rollouts: RolloutSource
    if servers is None:

        def start_worker(bundle: int) -> Any:
            return cluster.actor(
                RolloutWorker,
                bundle,
                section.rollout_cpus,
                section.rollout_gpus,
                config,
                registry,
                sandbox,
                section.rollout_cpus,
            )

        bundles = [cluster.learners + index for index in range(section.rollout_workers)]  # after the
        workers = [start_worker(bundle) for bundle in bundles]  # learners' bundles, if they have any
        # Wait for every actor's model, so that a failing one stops the run here and step 1's
        # timings measure the step, not the actors' start.
        places: list[Whereabouts] = ray.get([worker.whereabouts.remote() for worker in workers])
        collective = None
        if config.weight_sync is WeightSync.COLLECTIVE:
            cuda = config.model.device.startswith("cuda")
            backend = SyncBackend.NCCL if cuda else SyncBackend.GLOO
            collective = CollectiveSync.start(ray, workers, actor, backend)
        slots = [
            WorkerSlot(index, bundle, worker, where)
            for index, (bundle, worker, where) in enumerate(zip(bundles, workers, places, strict=True))
        ]
        rollouts = RayRollouts(
            ray,
            slots,
            start_worker,
            section.call_timeout_s,
            section.max_worker_restarts,
            collective,
            section.placement_timeout_s,
        )
    else:
        rollouts = servers
    if actor is not None:
        ray.get(actor.device.remote())
    return learner, rollouts
