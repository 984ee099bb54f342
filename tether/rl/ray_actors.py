"""The Ray backend's actors (`ray_backend.py`), plain classes wrapped with `ray.remote` when a run starts:
a rollout worker (an engine with its own copy of the policy, scoring with the environments, and a rank of
the run's weight-sync group) and the learner (the model, optimizer and LR schedule, and the group's
sender when the weights travel over it), or with `learner.strategy = "fsdp"` one learner rank per actor,
rank 0 doing the learner's part. `require_ray` is where Ray gets imported.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from tether.engine.weight_receiver import WeightReceiver
from tether.engine.weight_sync import WeightSender, WeightSyncConfig
from tether.envs.context import ScoringContext
from tether.errors import ConfigError
from tether.models.memory_plan import Strategy
from tether.models.threads import strict_matmul
from tether.rl.builders import make_engine, make_learner
from tether.rl.config import TrainConfig
from tether.rl.distributed import LearnerGroup, Rendezvous, local_init_method
from tether.rl.learner import Learner, LearnStats
from tether.rl.ray_failover import Whereabouts
from tether.rl.retries import RetryPolicy
from tether.rl.rollout import PromptPlan
from tether.rl.samples import Sample
from tether.rl.sharded import ShardedLearner
from tether.rl.sources import EngineRollouts, Generated
from tether.rl.trainer import sampling_params

if TYPE_CHECKING:
    from tether.envs.context import SandboxProvider
    from tether.envs.registry import EnvRegistry

Weights = dict[str, torch.Tensor]


def require_ray(setting: str = "run.backend") -> ModuleType:
    """The `ray` module (with `ray.util`'s placement groups loaded), or a `ConfigError` saying how to
    install it (or which `setting` to change instead)."""
    try:
        importlib.import_module("ray.util.scheduling_strategies")
        return importlib.import_module("ray")
    except ImportError:
        raise ConfigError(
            f"{setting} = 'ray' needs Ray, which is not installed: pip install 'tether[ray]' "
            f"(or set {setting} = 'local')"
        ) from None


def _use_cpus(cpus: float) -> None:
    # Torch would otherwise size its thread pool to the whole machine, not to the actor's share.
    torch.set_num_threads(max(1, math.floor(cpus)))


class RolloutWorker:
    """A Ray actor: an engine with its own copy of the policy, scoring with the environments."""

    def __init__(
        self, config: TrainConfig, registry: EnvRegistry, sandbox: SandboxProvider | None, cpus: float
    ) -> None:
        _use_cpus(cpus)
        torch.manual_seed(config.run.seed)
        engine, tokenizer = make_engine(config, config.model.device)
        params = sampling_params(config.rollout)
        self.rollouts = EngineRollouts(
            engine, tokenizer, registry, ScoringContext(sandbox), params, retry=RetryPolicy.of(config.rollout)
        )
        self.receiver: WeightReceiver | None = None

    def whereabouts(self) -> Whereabouts:
        """This actor's pid and node (for messages naming it); answering means the engine has loaded."""
        return Whereabouts.here(require_ray())

    def generate(self, plans: list[PromptPlan]) -> Generated:
        return self.rollouts.generate(plans)

    def load(self, weights: Weights, version: int) -> None:
        self.rollouts.load(weights.items(), version)

    def join_sync(self, config: WeightSyncConfig, rank: int) -> None:
        """Join the run's weight-sync group as engine `rank` (returns once every rank has joined)."""
        self.receiver = WeightReceiver(self.rollouts.engine, config, rank)

    def receive(self) -> int | None:
        """Take the sender's next message: the version the engine now serves, or None (refused, closed)."""
        assert self.receiver is not None, "join_sync first"
        return self.receiver.receive()

    def version(self) -> int:
        return self.rollouts.engine.policy_version

    def close(self) -> None:
        self.rollouts.close()


@dataclass(frozen=True, slots=True)
class LearnerState:
    """What a checkpoint holds of the learner, on the CPU."""

    model: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(item) for item in value)
    return value


class LearnerActor:
    """A Ray actor: the model, optimizer and LR schedule, updated from the driver's batches."""

    learner: Learner

    def __init__(self, config: TrainConfig, cpus: float) -> None:
        _use_cpus(cpus)
        self.cpus = cpus
        self.sender: WeightSender | None = None
        if config.learner.strategy is Strategy.SINGLE:  # a sharded one waits for its group (`join`)
            torch.manual_seed(config.run.seed)
            self.learner = make_learner(config, config.model.device)

    def device(self) -> str:
        """Where the learner runs; answering at all means the model has loaded."""
        return str(self.learner.device)

    def whereabouts(self) -> Whereabouts:
        """This actor's pid and node (for messages naming it)."""
        return Whereabouts.here(require_ray())

    def step(self, samples: list[Sample]) -> LearnStats:
        _use_cpus(self.cpus)  # torch's thread count is per thread, and a threaded actor has several
        return self.learner.step(samples)

    def weights(self) -> Weights:
        # The returned dict is serialised into the object store as it is now: a snapshot of this version.
        return {name: tensor.cpu() for name, tensor in self.learner.weights()}

    def state(self) -> LearnerState:
        learner = self.learner
        return LearnerState(
            _to_cpu(learner.trainable.state_dict()),
            _to_cpu(learner.optimizer.state_dict()),
            learner.scheduler.state_dict(),
        )

    def load_state(self, state: LearnerState) -> None:
        learner = self.learner
        learner.trainable.load_state_dict(state.model)
        learner.optimizer.load_state_dict(state.optimizer)
        learner.scheduler.load_state_dict(state.scheduler)

    def open_sync(self, settings: WeightSyncConfig) -> WeightSyncConfig:
        """Host the weight-sync group's store on this node; returns what the engines join it with."""
        host = require_ray().util.get_node_ip_address()
        self.sender = WeightSender(replace(settings, host=host))
        return replace(self.sender.config, port=self.sender.port)

    def connect_sync(self) -> None:
        assert self.sender is not None, "open_sync first"
        self.sender.connect()

    def send_weights(self, version: int, weights: Weights | None) -> None:
        """Broadcast `weights` (None: the learner's own, as they are now) as `version`; returns once every
        engine serves it."""
        assert self.sender is not None, "open_sync first"
        self.sender.send(self.learner.weights() if weights is None else weights, version)
        self.sender.wait_applied(version)

    def close_sync(self) -> None:
        if self.sender is not None:
            self.sender.close()


class LearnerRank(LearnerActor):
    """A Ray actor: one rank of a sharded learner (`sharded.py`), one per bundle. The driver has rank 0
    pick the rendezvous (`address`), every rank `join` the group at once, then ranks > 0 `follow` (one
    long call, returning when rank 0 says stop) while the driver calls rank 0 as it would a
    `LearnerActor`; rank 0's `close` releases them."""

    def __init__(self, config: TrainConfig, cpus: float) -> None:
        super().__init__(config, cpus)
        self.config = config

    def address(self) -> str:
        """A free TCP port on this actor's node, as the group's `init_method`."""
        return local_init_method(require_ray().util.get_node_ip_address())

    def join(self, rank: int, init_method: str) -> str:
        """Join the learner's group as `rank` (returns once every rank has) and build this rank's shard
        of the learner; returns its device."""
        config = self.config
        if config.model.strict_matmul:
            strict_matmul()  # the same MKL mode on every rank, as `tether train`'s ranks
        torch.manual_seed(config.run.seed)
        # Ray gives each actor only its own GPUs (CUDA_VISIBLE_DEVICES): its device is always cuda:0.
        rendezvous = Rendezvous(rank, config.learner.world_size, init_method)
        group = LearnerGroup(rendezvous, config.model.device, config.learner.timeout_s)
        try:
            self.learner = make_learner(config, str(group.device), group)
        except BaseException:
            group.close()
            raise
        return str(self.learner.device)

    def follow(self) -> None:
        assert isinstance(self.learner, ShardedLearner)
        try:
            self.learner.follow()
        finally:
            self.learner.group.close()

    def save_state(self, directory: str) -> None:
        """Every rank writes its shards into `directory` (rank 0 leads); returns once they are written."""
        self.learner.save_state(Path(directory))
        self.learner.wait_saved()

    def load_state_from(self, directory: str) -> None:
        self.learner.load_state(Path(directory))

    def close(self) -> None:
        """Rank 0: release the other ranks from `follow`, then leave the group."""
        self.learner.close()
