"""The Ray backend's rollout fleet: a `RolloutSource` over rollout worker actors that survives losing them.

Each worker generates and scores a shard of the step's prompts. A worker that dies or does not answer
within `[ray] call_timeout_s` is killed and replaced by a fresh actor in its placement-group bundle,
brought to the fleet's policy version through the object store, and its shard is issued again with the
same plans, hence the same sampling seeds: a sync run's tokens do not depend on which engine made them,
so the step's rollouts are what they would have been. Over a collective the weight-sync group is formed
again with the new worker once the step's shards are in; a worker lost while pulling weights from the
object store is replaced the same way (counted with the next step). At most `[ray] max_worker_restarts`
replacements per run; then the step fails with an `ActorLostError` naming the worker. Replacements and
the samples issued again are counted in `Generated.counters`. Not covered: a worker lost while a
collective broadcast is under way (the broadcast fails after the group's timeout, naming its rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from tether.errors import InfraReason
from tether.rl.ray_failover import (
    ActorLostError,
    ActorName,
    Deadlines,
    LearnerLostError,
    Whereabouts,
    answer,
    lost,
)
from tether.rl.ray_plan import merge_shards, shard_plans
from tether.rl.ray_sync import CollectiveSync
from tether.rl.rollout import PromptPlan
from tether.rl.sources import Generated

Weights = dict[str, torch.Tensor]
WORKERS_REPLACED = "rollout/workers_replaced"


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
            try:
                weights: Weights = self.ray.get(self.ref)
            except self.ray.exceptions.RayActorError as error:
                message = f"the learner actor died while its weights were copied: {type(error).__name__}"
                raise LearnerLostError(message, hung=False) from error
            self._items = iter(weights.items())
        return next(self._items)


@dataclass(slots=True)
class WorkerSlot:
    """A rollout worker's place in the fleet: its bundle outlives the actor in it."""

    index: int
    bundle: int
    handle: Any
    where: Whereabouts

    @property
    def name(self) -> ActorName:
        return ActorName(f"rollout worker {self.index}", self.where)


# Starts a rollout worker actor in a bundle of the run's placement group.
StartWorker = Callable[[int], Any]


class RayRollouts:
    """A `RolloutSource` over rollout worker actors, replacing the ones it loses (module docstring)."""

    def __init__(
        self,
        ray: ModuleType,
        slots: Sequence[WorkerSlot],
        start_worker: StartWorker,
        call_timeout_s: float,
        max_restarts: int,
        collective: CollectiveSync | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        self.ray = ray
        self.slots = list(slots)
        self.start_worker = start_worker
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s  # a replacement's placement, on top of call_timeout_s
        self.restarts_left = max_restarts
        self.max_restarts = max_restarts
        self.collective = collective  # None: weights travel through the object store
        self._version = 0  # the version every worker holds (they start with the model's own, 0)
        # What a replacement is brought up to date from: the weights of `_version`, as `load` got them.
        self._weights: RemoteWeights | Weights | Any = None
        self._lost: set[int] = set()  # slots whose actor is gone for good (no replacement was left)
        self._replaced_between_steps = 0  # workers replaced while loading weights

    @property
    def workers(self) -> list[Any]:
        return [slot.handle for slot in self.slots]

    def generate(self, plans: Sequence[PromptPlan]) -> Generated:
        shards = shard_plans(plans, len(self.slots))
        busy = [index for index, shard in enumerate(shards) if shard]

        def issue(index: int) -> Any:
            return self.slots[index].handle.generate.remote(shards[index])

        outputs, replaced = self._gather("generate", busy, issue, again=True)
        if replaced and self.collective is not None:
            # Every worker is idle now: the group forms again with the replacements (they hold the
            # fleet's version already, from the object store).
            self.collective = self.collective.reform(self.workers)
        for index in set(replaced):
            for rollout in outputs[index].rollouts:
                rollout.retry_reasons.extend([InfraReason.WORKER_LOST.value] * replaced.count(index))
        merged = merge_shards(plans, [outputs[index] for index in busy])
        counters = {
            WORKERS_REPLACED: float(len(replaced) + self._replaced_between_steps),
        }
        self._replaced_between_steps = 0
        for key, value in counters.items():
            if value:
                merged.counters[key] = merged.counters.get(key, 0.0) + value
        return merged

    def _gather(
        self, method: str, indices: Iterable[int], issue: Callable[[int], Any], again: bool
    ) -> tuple[dict[int, Any], list[int]]:
        """`issue(index)`, a call to slot `index`'s actor, for each of `indices`, and their answers by slot,
        each within the deadline; a lost worker is replaced (and with `again` its call issued to the
        replacement). Returns the answers and the slots replaced, once per replacement."""
        answers: dict[int, Any] = {}
        replaced: list[int] = []
        calls: dict[Any, int] = {}  # an outstanding call -> its slot
        deadlines = Deadlines(self.call_timeout_s)

        def start(index: int) -> None:
            calls[issue(index)] = index
            deadlines.start(index)

        def replace(index: int, error: Exception | None) -> None:
            self._replace(index, method, error)
            replaced.append(index)
            if again:
                start(index)

        for index in indices:
            start(index)
        while calls:
            ready, _ = self.ray.wait(list(calls), num_returns=1, timeout=deadlines.wait_s())
            for ref in ready:
                index = calls.pop(ref)
                deadlines.done(index)
                try:
                    answers[index] = self.ray.get(ref)
                except self.ray.exceptions.RayActorError as error:
                    replace(index, error)
            for index in deadlines.overdue():
                for ref in [ref for ref, slot in calls.items() if slot == index]:
                    del calls[ref]
                deadlines.done(index)
                replace(index, None)
        return answers, replaced

    def _replace(self, index: int, method: str, error: Exception | None) -> None:
        """Kill slot `index`'s actor and start another in its bundle at the fleet's version, or raise
        `ActorLostError` when no replacement is left."""
        slot = self.slots[index]
        message = lost(self.ray, slot.handle, slot.name, method, self.call_timeout_s, error)
        self._lost.add(index)  # until a replacement serves
        if self.restarts_left == 0:
            raise ActorLostError(
                f"{message}; no replacement left (ray.max_worker_restarts = {self.max_restarts})",
                hung=error is None,
            ) from error
        self.restarts_left -= 1
        handle = self.start_worker(slot.bundle)
        name = ActorName(f"rollout worker {index} (replacement)")
        # Placed (once the lost actor's resources are free) and its engine loaded, then one call.
        start_s = self.start_timeout_s + self.call_timeout_s
        where: Whereabouts = answer(self.ray, handle, handle.whereabouts.remote(), name, "start", start_s)
        self.slots[index] = WorkerSlot(index, slot.bundle, handle, where)
        if self._version > 0:
            ref = self._weights_ref()
            load = handle.load.remote(ref, self._version)
            answer(self.ray, handle, load, self.slots[index].name, "load", self.call_timeout_s)
        self._lost.discard(index)

    def _weights_ref(self) -> Any:
        weights = self._weights
        if isinstance(weights, RemoteWeights):
            return weights.ref  # sync mode: the learner actor has not stepped since it sent them
        if isinstance(weights, dict):
            self._weights = self.ray.put(weights)  # once, however many replacements need it
            return self._weights
        return weights  # already in the object store

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Broadcast from where the weights are (the learner actor's own, or this process's), or one copy
        into the object store (the learner actor's own when they come from it) that every worker pulls."""
        if version == self._version:
            return  # a version's weights never change (version 0: the engines loaded them themselves)
        self._weights = None  # the previous version's copy goes before the next is made
        if self.collective is not None:
            # Kept (tensors by reference, no copy) for a replacement: they are this version until the
            # next `load`, since a step generates before it learns.
            source = weights if isinstance(weights, RemoteWeights) else dict(weights)
            self.collective.push(None if isinstance(source, RemoteWeights) else source.items(), version)
            self._weights = source
            self._version = version
        else:
            ref = weights.ref if isinstance(weights, RemoteWeights) else self.ray.put(dict(weights))
            self._weights, self._version = ref, version  # what a replacement loads, from now on

            def issue(index: int) -> Any:
                return self.slots[index].handle.load.remote(ref, version)

            _, replaced = self._gather("load", range(len(self.slots)), issue, again=False)
            self._replaced_between_steps += len(replaced)  # counted with the next step

    def versions(self) -> list[int]:
        """The policy version each worker's engine holds."""
        versions: list[int] = self.ray.get([worker.version.remote() for worker in self.workers])
        return versions

    def close(self) -> None:
        """Release the workers still there (their receivers, sandbox pools and loops)."""
        alive = [slot.handle for slot in self.slots if slot.index not in self._lost]
        try:
            if self.collective is not None:
                self.collective.close(alive)
        finally:
            self.ray.get([worker.close.remote() for worker in alive])
