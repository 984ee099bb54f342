"""Weights to Ray rollout workers over a collective (`[rollout] weight_sync = "collective"`).

The sender (rank 0 of `engine/weight_sync.py`'s group) lives where the weights are: in this process when
the learner is local, in the learner actor when it is one, so a sync-mode update never passes through the
driver, which only coordinates (async mode's snapshots are the driver's own copies: those it sends through
the learner actor). Each rollout worker is rank 1..N, a `WeightReceiver` over its `LLMEngine`, taking one
message per `receive()` between generate calls. When the fleet replaces a worker, the group forms
again (`reform`): the new rank cannot join a group that has formed. Ray itself is passed in, never imported
here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from types import ModuleType
from typing import Any

import torch

from tether.engine.weight_sync import SyncBackend, WeightSender, WeightSyncConfig, WeightSyncError
from tether.rl.ray_failover import LearnerLostError

# How long workers may take to return from `receive` once the sender failed (they wait for its message
# until the group's timeout otherwise; a lost learner has every actor killed anyway).
_RELEASE_S = 5.0


class CollectiveSync:
    """The group of one run: its sender here or in `learner` (the learner actor), the workers' receivers.

    `start` forms it (every worker joins while the sender waits for them); `push` moves one version and
    returns once every worker's engine serves it; `close` releases the workers' receivers; `reform` closes
    it and forms it again over a new set of workers."""

    def __init__(
        self,
        ray: ModuleType,
        workers: list[Any],
        learner: Any | None,
        sender: WeightSender | None,
        backend: SyncBackend,
    ) -> None:
        assert (learner is None) != (sender is None), "the sender is either here or in the learner actor"
        self.ray = ray
        self.workers = workers
        self.learner = learner
        self.sender = sender
        self.backend = backend

    @classmethod
    def start(
        cls, ray: ModuleType, workers: list[Any], learner: Any | None, backend: SyncBackend
    ) -> CollectiveSync:
        settings = WeightSyncConfig(num_engines=len(workers), backend=backend)
        if learner is not None:
            config: WeightSyncConfig = ray.get(learner.open_sync.remote(settings))
            joins = [worker.join_sync.remote(config, rank) for rank, worker in enumerate(workers, 1)]
            ray.get([learner.connect_sync.remote(), *joins])
            return cls(ray, workers, learner, None, backend)
        sender = WeightSender(replace(settings, host=ray.util.get_node_ip_address()))
        config = replace(sender.config, port=sender.port)
        joins = [worker.join_sync.remote(config, rank) for rank, worker in enumerate(workers, 1)]
        sender.connect()  # waits for every worker to join
        ray.get(joins)
        return cls(ray, workers, None, sender, backend)

    def push(self, weights: Iterable[tuple[str, torch.Tensor]] | None, version: int) -> None:
        """Every worker's engine serves `version` on return. `weights` None: the learner actor's current
        weights (only with a learner actor)."""
        receives = [worker.receive.remote() for worker in self.workers]
        try:
            if self.sender is not None:
                assert weights is not None, "a sender in this process sends the weights it is given"
                self.sender.send(weights, version)
                self.sender.wait_applied(version)
            else:
                assert self.learner is not None
                payload = None if weights is None else self.ray.put(dict(weights))
                try:
                    self.ray.get(self.learner.send_weights.remote(version, payload))
                except self.ray.exceptions.RayActorError as error:
                    raise LearnerLostError(
                        f"the learner actor died while sending version {version} to the rollout workers: "
                        f"{type(error).__name__}",
                        hung=False,
                    ) from error
        except BaseException:
            # A refused update releases the workers at once; a failed sender leaves them waiting.
            self.ray.wait(receives, num_returns=len(receives), timeout=_RELEASE_S)
            raise
        versions: list[int | None] = self.ray.get(receives)
        if versions != [version] * len(versions):
            raise WeightSyncError(f"weight sync: workers hold versions {versions}, expected {version}")

    def reform(self, workers: list[Any]) -> CollectiveSync:
        """The group closed (over its workers still in `workers`: the others are gone) and formed again
        over `workers`, every one of which must hold the same version already."""
        self.close([worker for worker in self.workers if worker in workers])
        return CollectiveSync.start(self.ray, workers, self.learner, self.backend)

    def close(self, workers: list[Any] | None = None) -> None:
        """Tell every worker's receiver (of `workers`, default all) the group is done (each answers while
        it takes the message)."""
        receives = [worker.receive.remote() for worker in (self.workers if workers is None else workers)]
        if self.sender is not None:
            self.sender.close()
        elif self.learner is not None:
            self.ray.get(self.learner.close_sync.remote())
        self.ray.get(receives)
