"""Ray actors lost mid-run: a rollout worker killed by pid or stalled past `ray.call_timeout_s` is
replaced and its prompts issued again with their seeds (the run trains what an undisturbed run trains),
a stall with no replacement left fails naming the worker, and a learner actor killed mid-run makes the
run resume from its last checkpoint on new actors; an async run's rollout thread gets a replacement too.
On the module's local Ray cluster (2 CPUs)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tether.rl.ray_backend import RESUMPTIONS, RayTrainer
from tether.rl.ray_failover import ActorLostError, LearnerLostError
from tether.rl.ray_rollouts import WORKERS_REPLACED, RayRollouts

from .fake_envs import fake_registry
from .ray_faults import StallingWorker, arm_stall, stalled_pid
from .test_ray_backend import _ray_config, _ray_trainer, _stable, ray_cluster  # noqa: F401
from .test_trainer import make_trainer, tiny_config

Metrics = dict[str, float]


def _undisturbed(metrics: Metrics) -> Metrics:
    """The metrics without what failover counts (replacements, re-issued samples: overall and per domain)."""
    return {k: v for k, v in metrics.items() if "rollout/retried" not in k and k != WORKERS_REPLACED}


RETRIED_WORKER_LOST = "rollout/retried/worker_lost"
on_ray = pytest.mark.usefixtures("ray_cluster")  # one local Ray cluster for the module


@pytest.fixture
def stalling_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fleet starts workers (and their replacements) from this name: every one can stall on demand.
    monkeypatch.setattr("tether.rl.ray_backend.RolloutWorker", StallingWorker)


def _local_run(model: Path, out_dir: Path, **sections: Mapping[str, object]) -> list[Metrics]:
    local = make_trainer(tiny_config(model, out_dir, **sections))
    try:
        return local.run()
    finally:
        local.close()


def _run(trainer: RayTrainer, on_step: Callable[[Metrics], None] | None = None) -> list[Metrics]:
    try:
        return trainer.run(on_step)
    finally:
        trainer.close()


@on_ray
def test_a_rollout_worker_killed_by_pid_mid_step_is_replaced_and_the_run_trains_the_same_samples(
    tiny_model: Callable[[str], Path], tmp_path: Path, stalling_workers: None
) -> None:
    model = tiny_model("qwen3")
    expected = _local_run(model, tmp_path / "local")
    config = _ray_config(model, tmp_path / "ray", workers=2)
    trainer = _ray_trainer(config)
    assert isinstance(trainer.rollouts, RayRollouts) and trainer.rollouts.collective is not None
    killed: list[int] = []

    def kill_the_stalled_worker() -> None:
        pid = stalled_pid(config.run_dir)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    def stall_step_two(metrics: Metrics) -> None:
        if metrics["step"] == 1:  # one of step 2's workers stalls until this thread kills its process
            arm_stall(config.run_dir)
            threading.Thread(target=kill_the_stalled_worker, daemon=True).start()

    pids = [slot.where.pid for slot in trainer.rollouts.slots]
    try:
        history = trainer.run(stall_step_two)
        assert trainer.rollouts.versions() == [3, 3]  # the re-formed group serves the replacement too
        assert killed and killed[0] in pids and killed[0] not in [s.where.pid for s in trainer.rollouts.slots]
    finally:
        trainer.close()
    assert [m["step"] for m in history] == [1, 2, 3]
    assert history[1][WORKERS_REPLACED] == 1
    # The lost shard (2 of the 3 prompts, or 1) is issued again, 4 samples each.
    assert history[1][RETRIED_WORKER_LOST] in (4, 8)
    assert WORKERS_REPLACED not in history[0] and WORKERS_REPLACED not in history[2]
    # Same plans, seeds and weights on the replacement: what an undisturbed run trains, step for step.
    assert [m["trained_sequences"] for m in history] == [m["trained_sequences"] for m in expected]
    assert [m["reward"] for m in history] == [m["reward"] for m in expected]
    for got, want in zip(history, expected, strict=True):
        assert _stable(_undisturbed(got)) == pytest.approx(_stable(_undisturbed(want)), abs=1e-5)


@on_ray
def test_a_stalled_worker_with_no_replacement_left_fails_the_step_naming_it(
    tiny_model: Callable[[str], Path], tmp_path: Path, stalling_workers: None
) -> None:
    ray = {"rollout_workers": 1, "call_timeout_s": 5.0, "max_worker_restarts": 0}
    config = tiny_config(tiny_model("qwen3"), tmp_path, rollout={"backend": "ray"}, ray=ray)
    trainer = _ray_trainer(config)
    assert isinstance(trainer.rollouts, RayRollouts)
    pid = trainer.rollouts.slots[0].where.pid
    arm_stall(config.run_dir)
    started = time.monotonic()
    message = (
        rf"rollout worker 0 \(pid {pid}, node [\d.]+\) did not answer generate within 5 s "
        r"\(ray.call_timeout_s\); it was killed; no replacement left \(ray.max_worker_restarts = 0\)"
    )
    with pytest.raises(ActorLostError, match=message) as failure:
        _run(trainer)
    assert failure.value.hung
    assert time.monotonic() - started < 30  # the deadline, not the stall (an hour)


@on_ray
@pytest.mark.slow  # a third set of actors; the object-store path's fast smoke: test_ray_rollouts.py
def test_a_stalled_worker_is_replaced_through_the_object_store(
    tiny_model: Callable[[str], Path], tmp_path: Path, stalling_workers: None
) -> None:
    model = tiny_model("qwen3")
    expected = _local_run(model, tmp_path / "local", run={"steps": 2})
    ray = {"rollout_workers": 1, "call_timeout_s": 5.0, "max_worker_restarts": 1}
    rollout = {"backend": "ray", "weight_sync": "object_store"}
    config = tiny_config(model, tmp_path / "ray", rollout=rollout, ray=ray, run={"steps": 2})

    def stall_step_two(metrics: Metrics) -> None:
        if metrics["step"] == 1:
            arm_stall(config.run_dir)

    history = _run(_ray_trainer(config), stall_step_two)
    # The replacement got version 1 from the object store (the learner is in this process) and made
    # step 2's rollouts with the same seeds.
    assert [m.get(WORKERS_REPLACED, 0) for m in history] == [0, 1]
    assert history[1][RETRIED_WORKER_LOST] == 12
    assert [m["reward"] for m in history] == [m["reward"] for m in expected]
    assert [m["trained_sequences"] for m in history] == [m["trained_sequences"] for m in expected]
    report = (config.run_dir / "report.html").read_text()
    assert "1 rollout worker(s) replaced" in report


@on_ray
def test_a_learner_actor_killed_mid_run_resumes_from_its_last_checkpoint_and_finishes(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    model = tiny_model("qwen3")
    run = {"steps": 4, "checkpoint_every": 2}
    expected = _local_run(model, tmp_path / "local", run=run)
    config = _ray_config(model, tmp_path / "ray", run=run)
    trainer = _ray_trainer(config)
    assert trainer.remote is not None and trainer.remote.name.where is not None
    first_pid = trainer.remote.name.where.pid

    def kill_the_learner(metrics: Metrics) -> None:
        if metrics["step"] == 3 and RESUMPTIONS not in metrics:  # after the checkpoint of step 2
            os.kill(first_pid, signal.SIGKILL)

    try:
        history = trainer.run(kill_the_learner)
        assert trainer.resumptions == 1
        assert trainer.remote is not None and trainer.remote.name.where is not None
        assert trainer.remote.name.where.pid != first_pid  # a new learner actor
    finally:
        trainer.close()
    # Step 4 found the learner gone: steps 3 and 4 ran again from the checkpoint of step 2.
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    assert [m.get(RESUMPTIONS, 0) for m in history] == [0, 0, 1, 1]
    assert [m["reward"] for m in history] == [m["reward"] for m in expected]
    for got, want in zip(history, expected, strict=True):
        got = {k: v for k, v in got.items() if k != RESUMPTIONS}
        assert _stable(got) == pytest.approx(_stable(want), abs=1e-5)
    lines = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    report = (config.run_dir / "report.html").read_text()
    assert re.search(r"Resumed from its last checkpoint 1 time\(s\) after losing the learner", report)


def test_a_lost_learner_with_no_resumption_left_stops_the_run_naming_the_limit(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    config = tiny_config(
        tiny_model("qwen3"), tmp_path, run={"backend": "ray"}, ray={"max_learner_restarts": 0}
    )
    unused: Any = SimpleNamespace()  # nothing is started, loaded or killed on the way out

    def restart() -> Any:
        raise AssertionError("no restart is left")

    trainer = RayTrainer(config, unused, unused, fake_registry(), unused, restart)
    message = r"the learner actor died; the run already resumed 0 time\(s\) \(ray.max_learner_restarts = 0\)"
    with pytest.raises(LearnerLostError, match=message) as stopped:
        trainer.resume_after(LearnerLostError("the learner actor died", hung=False))
    assert not stopped.value.hung and trainer.resumptions == 0


@on_ray
@pytest.mark.slow  # another set of actors; the fleet's logic is the sync tests'
def test_an_async_run_replaces_a_stalled_worker_and_keeps_the_staleness_bound(
    tiny_model: Callable[[str], Path], tmp_path: Path, stalling_workers: None
) -> None:
    run = {"steps": 3, "checkpoint_every": 5, "mode": "async", "max_staleness": 1}
    model = tiny_model("qwen3")
    expected = _local_run(model, tmp_path / "local", run=run)
    ray = {"rollout_workers": 1, "learner_cpus": 1.0, "rollout_cpus": 1.0, "call_timeout_s": 10.0}
    config = tiny_config(model, tmp_path / "ray", run={**run, "backend": "ray"}, ray=ray)
    arm_stall(config.run_dir)  # the rollout thread's first batch stalls: the replacement makes it
    history = _run(_ray_trainer(config))
    assert [m.get(WORKERS_REPLACED, 0) for m in history] == [1, 0, 0]
    assert [m["staleness_max"] for m in history] == [0, 1, 1]
    assert [m["reward"] for m in history] == [m["reward"] for m in expected]
