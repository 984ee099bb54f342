"""Starting the learner ranks of a sharded run: rank 0 with the trainer, the others following it.

Under torchrun every rank runs `tether train`; rank 0 becomes the trainer and ranks > 0 call
`follow_rank`. Without torchrun, `open_learner_group` on rank 0 spawns ranks 1..N-1 itself (fresh
Python processes, a TCP rendezvous on a free local port) and joins them when the group closes. Every
rank builds the same learner from the same config; only rank 0 loads a rollout engine.
"""

from __future__ import annotations

import multiprocessing
import os

import torch

from tether.errors import ConfigError
from tether.models.memory_plan import Strategy
from tether.models.threads import available_cores, strict_matmul
from tether.rl.config import TrainConfig
from tether.rl.distributed import LearnerGroup, Rendezvous, local_init_method
from tether.rl.sections import Backend


def follow_rank(config: TrainConfig, rendezvous: Rendezvous) -> None:
    """The whole life of a rank > 0: join the group, build its shard of the learner, follow rank 0."""
    from tether.rl.builders import make_learner
    from tether.rl.sharded import ShardedLearner

    if config.model.strict_matmul:
        strict_matmul()  # the same MKL mode as rank 0, or the ranks' logprobs differ in the last bits
    torch.manual_seed(config.run.seed)
    group = LearnerGroup(rendezvous, config.model.device, config.learner.timeout_s)
    try:
        learner = make_learner(config, str(group.device), group)
        assert isinstance(learner, ShardedLearner)
        learner.follow()
    finally:
        group.close()


def _spawned(config: TrainConfig, rendezvous: Rendezvous) -> None:
    # Ranks started here share this machine's cores with rank 0 (which also runs the rollout engine).
    torch.set_num_threads(max(1, available_cores() // config.learner.world_size))
    follow_rank(config, rendezvous)


def open_learner_group(config: TrainConfig) -> LearnerGroup:
    """This process's rank of `config`'s learner: torchrun's, or rank 0 of ranks started here."""
    section = config.learner
    rendezvous = Rendezvous.from_env(section.world_size)
    if rendezvous is not None:
        return LearnerGroup(rendezvous, config.model.device, section.timeout_s)
    init_method = local_init_method()
    context = multiprocessing.get_context("spawn")
    children = [
        context.Process(
            target=_spawned,
            args=(config, Rendezvous(rank, section.world_size, init_method, local_rank=rank)),  # GPU `rank`
            name=f"tether-learner-rank-{rank}",
        )
        for rank in range(1, section.world_size)
    ]
    for child in children:
        child.start()
    try:
        return LearnerGroup(
            Rendezvous(0, section.world_size, init_method), config.model.device, section.timeout_s, children
        )
    except BaseException:
        for child in children:
            child.kill()
            child.join()
        raise


def follower_rendezvous(config: TrainConfig) -> Rendezvous | None:
    """torchrun's rendezvous when this process is a rank > 0 of a sharded learner, else None."""
    if config.learner.strategy is Strategy.SINGLE:
        launched = os.environ.get("WORLD_SIZE", "1")
        if launched != "1":
            raise ConfigError(
                f"torchrun started {launched} ranks (WORLD_SIZE) but learner.strategy = 'single': set "
                f"learner.strategy = 'fsdp' and learner.world_size = {launched}, or run without torchrun"
            )
        return None
    if config.run.backend is Backend.RAY:
        return None  # its ranks are Ray actors: every torchrun rank gets build_ray_trainer's refusal
    rendezvous = Rendezvous.from_env(config.learner.world_size)
    return rendezvous if rendezvous is not None and rendezvous.rank > 0 else None
