"""A sharded learner on Ray actors (`learner.strategy = "fsdp"` with `run.backend = "ray"`): one
`LearnerRank` actor per rank, each in its own bundle of the run's placement group.

Rank 0 picks the rendezvous (a free port on its node), every rank joins the group at once, then ranks > 0
run `follow` (one long call each) while the driver talks to rank 0 as to a single learner actor. There
is no CPU copy on the driver: each rank writes and reads its own shards of a checkpoint in the run
directory (`checkpoint.py`), so the run directory must be one every learner actor's node reaches. A rank
that dies fails the driver's next call at once, naming it, rather than after the group's timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from tether.errors import TetherError
from tether.models.transformer import CausalLM
from tether.rl.config import TrainConfig
from tether.rl.learner import LearnStats
from tether.rl.ray_actors import LearnerRank
from tether.rl.ray_backend import RemoteLearner
from tether.rl.samples import Sample

if TYPE_CHECKING:
    from tether.rl.ray_backend import RayCluster

# How long a following learner rank may take to return once rank 0 has told it to stop.
_FOLLOWER_EXIT_S = 60.0
# How long to look for a following rank's failure behind one of rank 0's.
_PEER_FAILURE_S = 5.0


class LearnerRankError(TetherError):
    """A rank of a sharded learner on Ray actors failed or stopped: the run cannot go on."""


class RemoteShardedLearner(RemoteLearner):
    """The driver's handle on a sharded learner's actors: rank 0 (`actor`) leads, the others run
    `follow` (`following`: their calls); checkpoints are written and read by the ranks themselves."""

    copies_state = False

    def __init__(
        self, ray: ModuleType, actor: Any, config: TrainConfig, model: CausalLM, following: list[Any]
    ) -> None:
        super().__init__(ray, actor, config, model)
        self.following = following
        # A call failed: the ranks left may be stuck in a collective, and the cluster kills them all.
        self.failed = False

    def _get(self, ref: Any) -> Any:
        ready, _ = self.ray.wait([ref, *self.following], num_returns=1)
        if ready[0] is not ref:
            self._fail(ready[0])
        try:
            return self.ray.get(ref)
        except Exception:
            self.failed = True
            # Rank 0's collective may fail first when a peer is gone: name that peer if it is.
            ended = (
                self.following and self.ray.wait(self.following, num_returns=1, timeout=_PEER_FAILURE_S)[0]
            )
            if ended:
                self._fail(ended[0])
            raise

    def _fail(self, call: Any) -> None:
        """Raise what ended rank `call`'s `follow` before rank 0 told it to stop."""
        self.failed = True
        rank = 1 + self.following.index(call)
        try:
            self.ray.get(call)
        except Exception as error:
            raise LearnerRankError(f"learner rank {rank} (a Ray actor) failed: {error}") from error
        raise LearnerRankError(f"learner rank {rank} (a Ray actor) stopped before rank 0 told it to")

    def step(self, samples: Sequence[Sample]) -> LearnStats:
        stats: LearnStats = self._get(self.actor.step.remote(list(samples)))
        return stats

    def save_state(self, directory: Path) -> None:
        self._get(self.actor.save_state.remote(str(directory.resolve())))

    def load_state(self, directory: Path) -> None:
        self._get(self.actor.load_state_from.remote(str(directory.resolve())))

    def close(self) -> None:
        """Rank 0 tells the others to stop; each leaves the group (the cluster kills a stuck one, and
        all of them after a rank failed)."""
        if self.failed:
            return
        self._get(self.actor.close.remote())
        if self.following:
            ready, _ = self.ray.wait(
                self.following, num_returns=len(self.following), timeout=_FOLLOWER_EXIT_S
            )
            self.ray.get(ready)  # a rank's own error, if it had one


def start_ranks(
    ray: ModuleType, cluster: RayCluster, config: TrainConfig, concurrency: int
) -> tuple[Any, list[Any]]:
    """A sharded learner's actors, one per bundle: rank 0 picks the rendezvous on its node, every rank
    joins it (at once: each waits for the others), then ranks > 0 start following rank 0. Returns
    rank 0 and the following ranks' `follow` calls."""
    section = config.ray
    ranks = [
        cluster.actor(
            LearnerRank,
            rank,
            section.learner_cpus,
            section.learner_gpus,
            config,
            section.learner_cpus,
            concurrency=concurrency if rank == 0 else 1,
        )
        for rank in range(config.learner.world_size)
    ]
    init_method: str = ray.get(ranks[0].address.remote())
    joins = [actor.join.remote(rank, init_method) for rank, actor in enumerate(ranks)]
    # The group's own timeout bounds each join (a rank that never comes fails the others' init).
    ray.get(joins)
    return ranks[0], [actor.follow.remote() for actor in ranks[1:]]
