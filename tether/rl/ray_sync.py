"""Weights to Ray rollout workers over a collective (`[rollout] weight_sync = "collective"`).

The sender (rank 0 of `engine/weight_sync.py`'s group) lives where the weights are: in this process when
the learner is local, in the learner actor when it is one, so a sync-mode update never passes through the
driver, which only coordinates (async mode's snapshots are the driver's own copies: those it sends through
the learner actor). Each rollout worker is rank 1..N, a `WeightReceiver` over its `LLMEngine`, taking one
message per `receive()` between generate calls. Ray itself is passed in, never imported here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from types import ModuleType
from typing import Any

import torch

from tether.engine.weight_sync import SyncBackend, WeightSender, WeightSyncConfig, WeightSyncError


class CollectiveSync:
    """The group of one run: its sender here or in `learner` (the learner actor), the workers' receivers.

    `start` forms it (every worker joins while the sender waits for them); `push` moves one version and
    returns once every worker's engine serves it; `close` releases the workers' receivers."""

    def __init__(
        self, ray: ModuleType, workers: list[Any], learner: Any | None, sender: WeightSender | None
    ) -> None:
        assert (learner is None) != (sender is None), "the sender is either here or in the learner actor"
        self.ray = ray
        self.workers = workers
        self.learner = learner
        self.sender = sender

    @classmethod
    def start(
        cls, ray: ModuleType, workers: list[Any], learner: Any | None, backend: SyncBackend
    ) -> CollectiveSync:
        settings = WeightSyncConfig(num_engines=len(workers), backend=backend)
        if learner is not None:
            config: WeightSyncConfig = ray.get(learner.open_sync.remote(settings))
            joins = [worker.join_sync.remote(config, rank) for rank, worker in enumerate(workers, 1)]
            ray.get([learner.connect_sync.remote(), *joins])
            return cls(ray, workers, learner, None)
        sender = WeightSender(replace(settings, host=ray.util.get_node_ip_address()))
        config = replace(sender.config, port=sender.port)
        joins = [worker.join_sync.remote(config, rank) for rank, worker in enumerate(workers, 1)]
        sender.connect()  # waits for every worker to join
        ray.get(joins)
        return cls(ray, workers, None, sender)

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
                self.ray.get(self.learner.send_weights.remote(version, payload))
        finally:  # the workers return at once when the update was refused: never left waiting
            versions: list[int | None] = self.ray.get(receives)
        if versions != [version] * len(versions):
            raise WeightSyncError(f"weight sync: workers hold versions {versions}, expected {version}")

    def close(self) -> None:
        """Tell every worker's receiver the group is done (each answers while it takes the message)."""
        receives = [worker.receive.remote() for worker in self.workers]
        if self.sender is not None:
            self.sender.close()
        elif self.learner is not None:
            self.ray.get(self.learner.close_sync.remote())
        self.ray.get(receives)
