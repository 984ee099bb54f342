"""The rollout fleet's failover without Ray: a stand-in for the `ray` module runs each worker's calls at
once, and a worker can be scripted to die or to hang on its next `generate`. A lost worker's shard goes
to a replacement in the same bundle, loaded with the fleet's version, with the same plans (so the same
sampling seeds); the replacements and the samples issued again are counted; once no replacement is left
the step fails naming the worker. The same on a real Ray cluster: `test_ray_failover.py`."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tether.rl.ray_failover import ActorLostError, Whereabouts
from tether.rl.ray_rollouts import WORKERS_REPLACED, RayRollouts, WorkerSlot
from tether.rl.rollout import PromptPlan, Rollout
from tether.rl.sources import Generated


class ActorDied(Exception):
    """Stands in for `ray.exceptions.RayActorError`."""


@dataclass(eq=False)  # hashed by identity, as Ray's object refs are told apart
class Ref:
    value: Any = None
    error: Exception | None = None
    hangs: bool = False


@dataclass
class FakeWorker:
    """A worker actor: `fault` ('die' or 'hang') strikes its next generate call."""

    bundle: int
    pid: int
    fault: str | None = None
    held: int = 0  # the version its engine holds
    killed: bool = False
    calls: list[list[PromptPlan]] = field(default_factory=list)

    def call(self, method: str, *args: Any) -> Ref:
        if self.killed:
            return Ref(error=ActorDied(f"actor {self.pid} is dead"))
        if method == "generate":
            self.calls.append(args[0])
            fault, self.fault = self.fault, None
            if fault == "die":
                return Ref(error=ActorDied(f"actor {self.pid} died: SIGKILL"))
            if fault == "hang":
                return Ref(hangs=True)
            return Ref(_generated(args[0], self.held))
        if method == "load":
            if self.fault == "die":
                return Ref(error=ActorDied(f"actor {self.pid} died: SIGKILL"))
            self.held = args[1]
            return Ref()
        answers = {"whereabouts": Whereabouts(self.pid, "10.0.0.1"), "version": self.held}
        return Ref(answers.get(method))

    def __getattr__(self, method: str) -> Any:
        return SimpleNamespace(remote=lambda *args: self.call(method, *args))


def _generated(shard: Sequence[PromptPlan], version: int) -> Generated:
    # Token ids from the sampling seed: the same plan gives the same rollouts on any worker.
    rollouts = [
        Rollout(p.env, p.seed, p.group, [1], [p.sample_seed + i], [0.0], [version], "stop")
        for p in shard
        for i in range(2)
    ]
    return Generated([None] * len(shard), rollouts, 1.0, 0.5)  # type: ignore[list-item]


class FakeRay:
    """Just what `RayRollouts` calls of the `ray` module."""

    exceptions = SimpleNamespace(RayActorError=ActorDied)

    def __init__(self) -> None:
        self.stored: list[Any] = []

    def wait(self, refs: list[Ref], num_returns: int = 1, timeout: float | None = None) -> Any:
        ready = [ref for ref in refs if not ref.hangs]
        return ready, [ref for ref in refs if ref.hangs]

    def get(self, refs: Ref | list[Ref]) -> Any:
        if isinstance(refs, list):
            return [self.get(ref) for ref in refs]
        if refs.error is not None:
            raise refs.error
        return refs.value

    def kill(self, handle: FakeWorker, no_restart: bool = True) -> None:
        handle.killed = True

    def put(self, value: Any) -> Ref:
        self.stored.append(value)
        return Ref(value)


def _fleet(workers: int, max_restarts: int) -> tuple[RayRollouts, list[FakeWorker]]:
    started: list[FakeWorker] = []

    def start_worker(bundle: int) -> FakeWorker:
        worker = FakeWorker(bundle, pid=100 + len(started))
        started.append(worker)
        return worker

    slots = [
        WorkerSlot(i, 1 + i, w, Whereabouts(w.pid, "10.0.0.1"))
        for i, w in enumerate([start_worker(1 + i) for i in range(workers)])
    ]
    ray: Any = FakeRay()
    fleet = RayRollouts(ray, slots, start_worker, call_timeout_s=0.01, max_restarts=max_restarts)
    return fleet, started


PLANS = [PromptPlan("test/vowels", seed, group, 1000 + 10 * group) for group, seed in enumerate(range(4))]


@pytest.mark.parametrize("fault", ["die", "hang"])
def test_a_lost_worker_is_replaced_in_its_bundle_at_the_fleets_version_and_its_shard_issued_again(
    fault: str,
) -> None:
    fleet, started = _fleet(workers=2, max_restarts=1)
    undisturbed = fleet.generate(PLANS)
    fleet.load(iter([("w", torch.ones(1))]), 3)
    started[1].fault = fault
    out = fleet.generate(PLANS)
    replacement = started[2]
    assert started[1].killed and replacement.bundle == started[1].bundle
    assert replacement.held == 3  # brought to the fleet's version before it generated
    assert replacement.calls == [started[1].calls[-1]]  # the lost shard, with the same plans and seeds
    assert fleet.slots[1].handle is replacement and fleet.slots[1].where.pid == replacement.pid
    assert [r.completion_ids for r in out.rollouts] == [r.completion_ids for r in undisturbed.rollouts]
    assert [r.retries for r in out.rollouts] == [0] * 4 + [1] * 4  # worker 1's 2 prompts, 2 samples each
    assert out.counters == {WORKERS_REPLACED: 1.0}
    assert sum(r.retry_reasons.count("worker_lost") for r in out.rollouts) == 4
    assert fleet.generate(PLANS).counters == {}  # counted in the step it happened in only


def test_a_lost_worker_with_no_replacement_left_fails_the_step_naming_it_and_close_skips_it() -> None:
    fleet, started = _fleet(workers=2, max_restarts=0)
    started[0].fault = "hang"
    message = (
        "rollout worker 0 (pid 100, node 10.0.0.1) did not answer generate within 0.01 s "
        "(ray.call_timeout_s); it was killed; no replacement left (ray.max_worker_restarts = 0)"
    )
    with pytest.raises(ActorLostError, match=re.escape(message)) as failure:
        fleet.generate(PLANS)
    assert failure.value.hung and len(started) == 2
    fleet.close()  # the lost worker is not asked to close (it would raise)
    fleet2, workers = _fleet(workers=1, max_restarts=0)
    workers[0].fault = "die"
    with pytest.raises(
        ActorLostError,
        match=r"rollout worker 0 \(pid 100, node 10.0.0.1\) died during "
        r"generate: ActorDied: actor 100 died: SIGKILL; no replacement left",
    ) as died:
        fleet2.generate(PLANS)
    assert not died.value.hung


def test_a_worker_lost_while_it_loads_weights_is_replaced_at_that_version_and_counted_next_step() -> None:
    fleet, started = _fleet(workers=2, max_restarts=1)
    started[0].fault = "die"
    fleet.load(iter([("w", torch.ones(1))]), 1)
    assert started[0].killed and started[2].held == 1 and fleet.versions() == [1, 1]
    out = fleet.generate(PLANS)
    assert out.counters == {WORKERS_REPLACED: 1.0}  # nothing was generated twice
    assert all(r.retries == 0 for r in out.rollouts)
