"""Async mode: a rollout thread generates the next batches while the learner trains, within a staleness bound.

Batch s is generated with exactly the weights of policy version max(0, s - max_staleness), kept in a
`WeightStore` until no future batch needs them. Fixing the version (rather than taking whatever is newest)
keeps a run reproducible and resumable, and it is the freshest policy a pipeline of that depth can have.
The learner corrects for the lag with the importance ratio against the behaviour logprobs recorded at
generation (the clipped objective in `losses.py`). Only the rollout thread touches the rollout source (the
engine and scoring loop, or the Ray workers) while the pipeline runs; the learner thread owns the learner.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tether.rl.trainer import Metrics, Produced, Trainer

Weights = dict[str, torch.Tensor]
_POLL_S = 0.05


def generation_version(step: int, max_staleness: int) -> int:
    """The policy version batch `step` is generated with."""
    return max(0, step - max_staleness)


class WeightStore:
    """Weight snapshots by policy version, shared by the learner (puts) and the rollout thread (waits)."""

    def __init__(self) -> None:
        self._versions: dict[int, Weights] = {}
        self._changed = threading.Condition()

    def put(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        snapshot = {name: tensor.detach().clone() for name, tensor in weights.items()}
        with self._changed:
            self._versions[version] = snapshot
            self._changed.notify_all()

    def wait(self, version: int, stop: threading.Event) -> Weights | None:
        """The snapshot of `version` once it exists; None if `stop` is set first."""
        with self._changed:
            while version not in self._versions:
                if stop.is_set():
                    return None
                self._changed.wait(_POLL_S)
            return self._versions[version]

    def drop_below(self, version: int) -> None:
        with self._changed:
            for old in [v for v in self._versions if v < version]:
                del self._versions[old]

    def versions(self, below: int) -> dict[int, Weights]:
        """The snapshots older than `below` (what a checkpoint must keep for the batches still to come)."""
        with self._changed:
            return {v: w for v, w in self._versions.items() if v < below}


def run_async(trainer: Trainer, on_step: Callable[[Metrics], None] | None = None) -> list[Metrics]:
    """Train until `run.steps` or a stop request, generating up to `max_staleness` batches ahead."""
    config = trainer.config
    lag, steps = config.run.max_staleness, config.run.steps
    store = trainer.weight_store
    store.put(trainer.step, dict(trainer.learner.weights()))
    batches: queue.Queue[Produced] = queue.Queue(maxsize=lag + 1)
    stop = threading.Event()
    failures: list[BaseException] = []

    def produce() -> None:
        cursors = dict(trainer.cursors)
        try:
            for step in range(trainer.step, steps):
                version = generation_version(step, lag)
                weights = store.wait(version, stop)
                if weights is None:
                    return
                trainer.push(weights.items(), version)
                produced = trainer.produce(step, cursors)
                cursors = produced.cursors
                while not stop.is_set():
                    try:
                        batches.put(produced, timeout=_POLL_S)
                        break
                    except queue.Full:
                        continue
        except BaseException as error:  # re-raised on the learner thread, which owns the run
            failures.append(error)

    producer = threading.Thread(target=produce, name="tether-rollouts", daemon=True)
    producer.start()
    history: list[Metrics] = []
    try:
        while trainer.step < steps and not trainer.stop_requested:
            waited = trainer.clock()
            produced = _next_batch(batches, producer, failures)
            start = trainer.clock()
            metrics, _ = trainer.learn(produced)
            published = trainer.clock()
            store.put(trainer.step, dict(trainer.learner.weights()))
            store.drop_below(generation_version(trainer.step, lag))
            # The rollout thread loads these weights when a batch needs them; publishing is this mode's push.
            metrics["time/push_s"] = trainer.clock() - published
            metrics["time/wait_s"] = start - waited
            metrics["time/step_s"] = trainer.clock() - waited
            trainer.record(metrics)
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)
            trainer.maybe_checkpoint()
    finally:
        stop.set()
        producer.join()
    if failures:
        raise failures[0]
    return history


def _next_batch(
    batches: queue.Queue[Produced], producer: threading.Thread, failures: list[BaseException]
) -> Produced:
    while True:
        try:
            return batches.get(timeout=_POLL_S)
        except queue.Empty:
            if failures:
                raise failures[0] from None
            if not producer.is_alive():
                raise RuntimeError("the rollout thread ended without producing the next batch") from None
