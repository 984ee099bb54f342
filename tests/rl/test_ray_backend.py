"""The Ray backend on a local cluster: the learner and rollout workers as actors, same loop and run dir.

One Ray cluster (2 CPUs) serves the module. A sync run on two workers reproduces the local backend's
rewards step for step: the plan, every sampling seed and the weights are the same, and a request's tokens
do not depend on which engine (or batch) generated it; that holds whether the weights are broadcast over
a collective (from the learner actor, or from this process beside a local learner) or go through the
object store. A sharded learner of 2 rank actors (gloo) matches the local single learner, and its
checkpoint resumes on one. Async runs keep the staleness bound across
processes and resume (marked slow: each run starts its own actors, ~20-40 s here).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from tests.live_server import live_server
from tether.cli.main import app
from tether.engine.weight_sync import WeightSyncError
from tether.errors import ConfigError
from tether.rl.builders import build_trainer
from tether.rl.checkpoint import saved_model
from tether.rl.config import TrainConfig, parse_config
from tether.rl.ranks import follower_rendezvous
from tether.rl.ray_backend import (
    RayCluster,
    RayRollouts,
    RayTrainer,
    RemoteWeights,
    build_ray_trainer,
)
from tether.rl.ray_plan import merge_shards, plan_bundles, shard_plans
from tether.rl.ray_ranks import LearnerRankError, RemoteShardedLearner
from tether.rl.rollout import PromptPlan, Rollout
from tether.rl.sources import Generated

from .fake_envs import fake_registry
from .fake_vllm import FakeState, create_fake_vllm
from .test_cli_train import _write_config
from .test_trainer import make_trainer, tiny_config

# Wall-clock figures differ between any two runs; so do the prefix cache's hits (an engine's cache is not
# checkpointed, and each Ray worker has its own), and with them the split of prompt tokens and the cost.
VOLATILE = ("time/", "tokens_per_s", "sandbox/cpu_s", "tokens/prompt_", "cost/", "run/threads")


def _stable(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}


def _ray_config(
    model: Path, out_dir: Path, workers: int = 1, **sections: Mapping[str, object]
) -> TrainConfig:
    """`tiny_config` on the Ray backend: the learner and `workers` rollout workers share the 2 CPUs."""
    run = {"backend": "ray", **sections.get("run", {})}
    ray = {"rollout_workers": workers, "learner_cpus": 1.0, "rollout_cpus": 1.0 / workers}
    return tiny_config(model, out_dir, **{**sections, "run": run, "ray": ray})


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[ModuleType]:
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        object_store_memory=128 * 2**20,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def _ray_trainer(config: TrainConfig, resume: bool = False) -> RayTrainer:
    return build_ray_trainer(config, fake_registry(), resume=resume)


# --- pure pieces ---------------------------------------------------------------------------------------


def test_shards_cover_every_plan_and_merge_back_in_plan_order() -> None:
    plans = [PromptPlan("test/vowels", seed, group, 100 + group) for group, seed in enumerate(range(5))]
    shards = shard_plans(plans, 2)
    assert [[p.seed for p in shard] for shard in shards] == [[0, 1, 2], [3, 4]]
    assert [[p.group for p in shard] for shard in shards] == [[0, 1, 2], [0, 1]]  # renumbered per worker
    assert [p.sample_seed for shard in shards for p in shard] == [p.sample_seed for p in plans]
    assert shard_plans(plans[:1], 3)[1:] == [[], []]

    def generated(shard: list[PromptPlan], seconds: float) -> Generated:
        rollouts = [Rollout(p.env, p.seed, p.group, [1], [2], [0.0], [0], "stop") for p in shard]
        return Generated([None] * len(shard), rollouts, seconds, seconds / 2)

    outputs = [generated(shard, seconds) for shard, seconds in zip(shards, (1.0, 3.0), strict=True)]
    merged = merge_shards(plans, outputs)
    assert [(r.seed, r.group) for r in merged.rollouts] == [(p.seed, p.group) for p in plans]
    assert (merged.generate_s, merged.score_s) == (3.0, 1.5)  # workers run in parallel: the slowest


def test_placement_group_has_a_bundle_per_learner_rank_then_one_per_worker() -> None:
    config = parse_config(
        {
            "envs": {"weights": {"math/arithmetic": 1.0}},
            "run": {"backend": "ray"},
            "ray": {"rollout_workers": 3, "learner_cpus": 2, "rollout_cpus": 0.5, "rollout_gpus": 0.25},
        }
    )
    plan = plan_bundles("x", config.ray)
    assert plan.bundles == ({"CPU": 2.0},) + ({"CPU": 0.5, "GPU": 0.25},) * 3
    assert plan.strategy == "PACK"
    assert plan_bundles("x", config.ray, learners=0).bundles == ({"CPU": 0.5, "GPU": 0.25},) * 3
    assert plan_bundles("x", config.ray, workers=False).bundles == ({"CPU": 2.0},)
    # A sharded learner: one bundle per rank, each with the learner's resources, before the workers'.
    assert plan_bundles("x", config.ray, learners=2).bundles[:3] == ({"CPU": 2.0},) * 2 + (
        {"CPU": 0.5, "GPU": 0.25},
    )


@pytest.mark.parametrize(
    ("model", "ray", "message"),
    [
        ({"device": "cuda:1"}, {}, "model.device = 'cuda:1' with run.backend = 'ray': use 'cuda'"),
        ({"device": "cuda"}, {"learner_gpus": 1}, "needs ray.learner_gpus > 0 and ray.rollout_gpus > 0"),
        ({}, {"rollout_workers": 0}, "ray.rollout_workers = 0"),
        ({}, {"learner_cpus": 0}, "ray.learner_cpus = 0"),
        ({}, {"workers": 2}, "unknown key 'ray.workers'"),
        ({}, {"call_timeout_s": 0}, "ray.call_timeout_s = 0"),
        ({}, {"max_worker_restarts": -1}, "ray.max_worker_restarts = -1"),
        ({}, {"max_learner_restarts": 1.5}, "ray.max_learner_restarts = 1.5"),
        ({"device": "cuda:1"}, {"rollout": True}, "model.device = 'cuda:1' with rollout.backend = 'ray'"),
        (
            {"device": "cuda"},
            {"rollout": True},
            "rollout.backend = 'ray' needs ray.rollout_gpus > 0 (got 0.0)",
        ),
    ],
)
def test_bad_ray_settings_are_named(model: dict[str, object], ray: dict[str, object], message: str) -> None:
    # "rollout": only the engines are actors (rollout.backend = 'ray'), else the learner too (run.backend)
    only_rollouts = bool(ray.get("rollout"))
    ray = {key: value for key, value in ray.items() if key != "rollout"}
    raw = {
        "envs": {"weights": {"math/arithmetic": 1.0}},
        "model": model,
        "run": {} if only_rollouts else {"backend": "ray"},
        "rollout": {"backend": "ray"} if only_rollouts else {},
        "ray": ray,
    }
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(raw)


@pytest.mark.parametrize(
    ("sections", "setting"),
    [({"run": {"backend": "ray"}}, "run.backend"), ({"rollout": {"backend": "ray"}}, "rollout.backend")],
)
def test_ray_backend_without_ray_installed_says_how_to_install_it(
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sections: dict[str, Mapping[str, object]],
    setting: str,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    config = tiny_config(tiny_model("qwen3"), tmp_path, **sections)
    message = rf"{setting} = 'ray' needs Ray.*pip install 'tether\[ray\]' \(or set {setting} = 'local'\)"
    with pytest.raises(ConfigError, match=message):
        build_trainer(config, registry=fake_registry())
    assert not (tmp_path / "tiny").exists()


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("ray", "run.backend = 'ray' needs Ray, which is not installed"),
        ("slurm", "--backend: run.backend = 'slurm': Input should be 'local' or 'ray'"),
    ],
)
def test_train_backend_option_is_checked_and_chooses_the_backend(
    backend: str,
    message: str,
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    config = _write_config(tmp_path / "train.toml", tiny_model("llama"), tmp_path / "runs")
    result = CliRunner().invoke(app, ["train", "--config", str(config), "--backend", backend])
    assert result.exit_code != 0
    assert message in " ".join(result.output.split())


def test_a_sharded_learner_on_ray_actors_is_refused_under_torchrun(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = parse_config(
        {
            "envs": {"weights": {"math/arithmetic": 1.0}},
            "run": {"backend": "ray", "out_dir": str(tmp_path)},
            "learner": {"strategy": "fsdp", "world_size": 2},
        }
    )  # the config itself is fine: tether starts the ranks as actors
    assert follower_rendezvous(config) is None  # every torchrun rank, not only rank 0, is refused
    with pytest.raises(ConfigError, match="starts the learner ranks as Ray actors: run tether train without"):
        build_ray_trainer(config, fake_registry())
    assert not list(tmp_path.iterdir())


def test_unreachable_ray_address_is_named() -> None:
    def refuse(**options: object) -> None:
        raise ConnectionError(f"could not connect to {options['address']}")

    ray = SimpleNamespace(is_initialized=lambda: False, init=refuse)  # stands in for a cluster that is down
    config = parse_config(
        {"envs": {"weights": {"math/arithmetic": 1.0}}, "run": {"backend": "ray"}, "ray": {"address": "h:1"}}
    )
    message = "ray.address = 'h:1': cannot start or join a Ray cluster: could not connect to h:1"
    with pytest.raises(ConfigError, match=re.escape(message)):
        RayCluster(ray, config)


# --- on a local Ray cluster -----------------------------------------------------------------------------


def test_actors_the_cluster_cannot_fit_are_refused_with_what_it_has(
    tiny_model: Callable[[str], Path], tmp_path: Path, ray_cluster: ModuleType
) -> None:
    config = _ray_config(tiny_model("qwen3"), tmp_path)
    config = config.model_copy(
        update={"ray": config.ray.model_copy(update={"learner_cpus": 4.0, "placement_timeout_s": 1.0})}
    )
    with pytest.raises(ConfigError, match=r"cannot place this run's actors within 1 s: \[ray\] asks for"):
        _ray_trainer(config)
    assert all(group["state"] == "REMOVED" for group in ray_cluster.util.placement_group_table().values())
    assert not (tmp_path / "tiny").exists()


def test_sync_ray_run_matches_the_local_backend_and_writes_the_same_run_dir(
    tiny_model: Callable[[str], Path], tmp_path: Path, ray_cluster: ModuleType
) -> None:
    model = tiny_model("qwen3")
    local = make_trainer(tiny_config(model, tmp_path / "local"))
    expected = local.run()
    local.close()

    trainer = _ray_trainer(_ray_config(model, tmp_path / "ray", workers=2))
    try:
        history = trainer.run()
        assert isinstance(trainer.rollouts, RayRollouts) and trainer.remote is not None
        # weight_sync's default: the learner actor broadcasts its own weights; the driver only coordinates
        collective = trainer.rollouts.collective
        assert collective is not None and collective.sender is None and collective.learner is not None
        assert trainer.rollouts.versions() == [3, 3]  # every worker holds the last pushed version
        weights = trainer.learner.weights()
        assert isinstance(weights, RemoteWeights)
        trainer.push(weights, 4)
        assert trainer.rollouts.versions() == [4, 4] and not weights.copied  # never out of the actor
        # An older version is refused by every engine before any byte moves; they serve on.
        with pytest.raises(WeightSyncError, match="version 2 refused, nothing changed"):
            collective.push(None, 2)
        assert trainer.rollouts.versions() == [4, 4]
    finally:
        trainer.close()
    assert [m["step"] for m in history] == [1, 2, 3]
    assert [m["policy_version"] for m in history] == [1, 2, 3]
    assert [m["staleness_max"] for m in history] == [0, 0, 0]
    # Same plan, seeds and weights: the same tokens, so exactly the same rewards, step for step.
    assert [m["reward"] for m in history] == [m["reward"] for m in expected]
    for got, want in zip(history, expected, strict=True):
        assert got["learner/ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy across processes
        assert _stable(got) == pytest.approx(_stable(want), abs=1e-5)
    run_dir = tmp_path / "ray" / "tiny"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert (run_dir / "config.toml").read_text().count('backend = "ray"') == 1
    assert (run_dir / "checkpoints" / "step-000003").is_dir()
    assert len((run_dir / "transcripts.jsonl").read_text().splitlines()) == 6
    # The checkpoint the driver wrote holds the learner actor's weights, which equal the local learner's.
    saved = saved_model(run_dir / "checkpoints" / "step-000003")
    for name, param in local.learner.model.named_parameters():
        assert torch.allclose(saved[name], param.detach(), atol=1e-5), name


@pytest.mark.parametrize("weight_sync", ["collective", "object_store"])
def test_rollout_backend_ray_runs_only_the_engines_as_actors(
    tiny_model: Callable[[str], Path], tmp_path: Path, ray_cluster: ModuleType, weight_sync: str
) -> None:
    model = tiny_model("qwen3")
    local = make_trainer(tiny_config(model, tmp_path / "local", run={"steps": 2}))
    expected = local.run()
    local.close()
    # The learner stays in this process, two engine actors make the rollouts.
    ray = {"rollout_workers": 2, "rollout_cpus": 1.0}
    rollout = {"backend": "ray", "weight_sync": weight_sync}
    config = tiny_config(model, tmp_path / "ray", rollout=rollout, run={"steps": 2}, ray=ray)
    assert config.run.backend == "local"
    trainer = _ray_trainer(config)
    try:
        assert trainer.remote is None and isinstance(trainer.rollouts, RayRollouts)
        collective = trainer.rollouts.collective
        # Collective: the sender is in this process, beside the learner's weights.
        assert (collective is not None and collective.sender is not None) == (weight_sync == "collective")
        history = trainer.run()
        assert trainer.rollouts.versions() == [2, 2]  # both engines were sent versions 1 and 2
    finally:
        trainer.close()
    assert [m["policy_version"] for m in history] == [1, 2]
    assert [m["reward"] for m in history] == [m["reward"] for m in expected]  # same plan, seeds, weights
    assert all(m["learner/ratio_mean"] == pytest.approx(1.0, abs=1e-4) for m in history)
    lines = (tmp_path / "ray" / "tiny" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert all(group["state"] == "REMOVED" for group in ray_cluster.util.placement_group_table().values())


def test_a_learner_actor_pushes_its_versions_to_a_vllm_server(
    tiny_model: Callable[[str], Path], tmp_path: Path, ray_cluster: ModuleType
) -> None:
    state = FakeState()
    with live_server(create_fake_vllm(state)) as url:
        rollout = {"backend": "vllm", "base_urls": [url], "max_new_tokens": 6}
        config = _ray_config(tiny_model("qwen3"), tmp_path, rollout=rollout, run={"steps": 2})
        trainer = _ray_trainer(config)
        try:
            assert trainer.remote is not None  # the learner is an actor, the rollouts come from the server
            history = trainer.run()
        finally:
            trainer.close()
    assert [m["policy_version"] for m in history] == [1, 2]
    assert state.version == 2 and [Path(u["location"]).name for u in state.updates] == ["v1", "v2"]
    assert [p.name for p in (tmp_path / "tiny" / "weights").iterdir()] == ["v2"]


ASYNC: dict[str, Mapping[str, object]] = {
    "run": {"steps": 3, "checkpoint_every": 5, "mode": "async", "max_staleness": 1}
}


@pytest.mark.slow  # a second set of actors: ~40 s more on this 2-core machine
def test_async_ray_run_keeps_the_staleness_bound_across_processes(
    tiny_model: Callable[[str], Path], tmp_path: Path, ray_cluster: ModuleType
) -> None:
    model = tiny_model("qwen3")
    local = make_trainer(tiny_config(model, tmp_path / "local", **ASYNC))
    expected = local.run()
    local.close()
    trainer = _ray_trainer(_ray_config(model, tmp_path / "ray", **ASYNC))
    try:
        history = trainer.run()
    finally:
        trainer.close()
    assert [m["policy_version"] for m in history] == [1, 2, 3]
    assert [m["staleness_max"] for m in history] == [0, 1, 1]  # batch s generated with max(0, s - 1)
    assert history[2]["learner/ratio_mean"] != pytest.approx(1.0, abs=1e-6)  # off-policy, corrected
    for got, want in zip(history, expected, strict=True):
        assert _stable(got) == pytest.approx(_stable(want), abs=1e-5)


@pytest.mark.slow  # another set of actors
def test_async_run_of_a_sharded_learner_on_ray_actors_matches_the_local_learner(
    tiny_model: Callable[[str], Path], tmp_path: Path, ray_cluster: ModuleType
) -> None:
    # Rank 0 takes a step while it broadcasts the driver's snapshot of an older version to the engines.
    model = tiny_model("qwen3")
    local = make_trainer(tiny_config(model, tmp_path / "local", **ASYNC))
    expected = local.run()
    local.close()
    sharded = {"strategy": "fsdp", "world_size": 2, "timeout_s": 60}
    ray = {"rollout_workers": 1, "learner_cpus": 0.5, "rollout_cpus": 1.0}
    run = {**ASYNC["run"], "backend": "ray"}
    trainer = _ray_trainer(tiny_config(model, tmp_path / "ray", run=run, learner=sharded, ray=ray))
    try:
        history = trainer.run()
    finally:
        trainer.close()
    assert [m["staleness_max"] for m in history] == [0, 1, 1]
    for got, want in zip(history, expected, strict=True):
        assert _stable(got) == pytest.approx(_stable(want), abs=1e-5)


@pytest.mark.slow  # two more sets of actors
def test_killed_ray_run_resumes_where_it_stopped(
    tiny_model: Callable[[str], Path], tmp_path: Path, ray_cluster: ModuleType
) -> None:
    model = tiny_model("qwen3")
    local = make_trainer(tiny_config(model, tmp_path / "local", **ASYNC))
    expected = local.run()
    local.close()
    killed = _ray_trainer(_ray_config(model, tmp_path / "ray", **ASYNC))

    def kill_after_two(metrics: dict[str, float]) -> None:
        if metrics["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        first = killed.run(on_step=kill_after_two)
    finally:
        killed.close()
    assert [m["step"] for m in first] == [1, 2]
    # Batch 3 needs version 1's weights: the driver restores them from the checkpoint's snapshots, the
    # learner actor gets the checkpointed model, optimizer and schedule.
    resumed = _ray_trainer(_ray_config(model, tmp_path / "ray", **ASYNC), resume=True)
    try:
        rest = resumed.run()
    finally:
        resumed.close()
    assert [m["step"] for m in rest] == [3]
    assert _stable(rest[0]) == pytest.approx(_stable(expected[2]), abs=1e-5)


@pytest.mark.slow  # another set of actors
def test_train_command_runs_on_ray_in_async_mode(
    tiny_model: Callable[[str], Path], tmp_path: Path, ray_cluster: ModuleType
) -> None:
    config = _write_config(tmp_path / "train.toml", tiny_model("llama"), tmp_path / "runs")
    config.write_text(
        config.read_text().replace("checkpoint_every = 1", 'checkpoint_every = 1\nmode = "async"')
        + "\n[ray]\nlearner_cpus = 1.0\nrollout_cpus = 1.0\n"
    )
    result = CliRunner().invoke(app, ["train", "--config", str(config), "--backend", "ray"])
    assert result.exit_code == 0, result.output
    assert "step 2/2" in result.output
    lines = [
        json.loads(line) for line in (tmp_path / "runs" / "cli" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [(line["step"], line["staleness_max"]) for line in lines] == [(1, 0), (2, 1)]
    assert (tmp_path / "runs" / "cli" / "checkpoints" / "step-000002").is_dir()


def test_sharded_learner_on_ray_actors_matches_the_local_learner_and_its_checkpoint_resumes(
    tiny_model: Callable[[str], Path], tmp_path: Path, ray_cluster: ModuleType
) -> None:
    model = tiny_model("qwen3")
    local = make_trainer(tiny_config(model, tmp_path / "local"))
    expected = local.run()  # 3 steps, checkpoints at 2 and 3
    local.close()

    sharded = {"strategy": "fsdp", "world_size": 2, "timeout_s": 60}
    ray = {"rollout_workers": 1, "learner_cpus": 0.5, "rollout_cpus": 1.0}  # two ranks share a CPU
    config = tiny_config(
        model, tmp_path / "ray", run={"backend": "ray", "steps": 2}, learner=sharded, ray=ray
    )
    trainer = _ray_trainer(config)
    try:
        assert len(trainer.cluster.actors) == 3  # one learner actor per rank, then the rollout worker
        history = trainer.run()
        assert trainer.rollouts.versions() == [2]  # type: ignore[attr-defined]
        # A rank that dies fails the next step at once, naming it, instead of after the group's timeout.
        learner = trainer.learner
        assert isinstance(learner, RemoteShardedLearner) and len(learner.following) == 1
        ray_cluster.kill(trainer.cluster.actors[1])
        started = time.monotonic()
        with pytest.raises(LearnerRankError, match="learner rank 1 \\(a Ray actor\\) failed"):
            learner.step([])
        assert time.monotonic() - started < 30
    finally:
        trainer.close()
    assert [m["reward"] for m in history] == [m["reward"] for m in expected[:2]]
    for got, want in zip(history, expected, strict=False):
        assert _stable(got) == pytest.approx(_stable(want), abs=1e-5)
    # Each rank wrote its shards into the run directory; they read back as the local learner's weights.
    run_dir = tmp_path / "ray" / "tiny"
    state = run_dir / "checkpoints" / "step-000002" / "state"
    assert len(list(state.glob("*.distcp"))) == 2
    saved = saved_model(state.parent)
    for name, tensor in saved_model(tmp_path / "local" / "tiny" / "checkpoints" / "step-000002").items():
        assert torch.allclose(saved[name], tensor, atol=1e-5), name
    # The 2-rank checkpoint resumes on a single local learner: step 3 is the uninterrupted run's.
    resumed = make_trainer(tiny_config(model, tmp_path / "ray"), resume=True)
    try:
        rest = resumed.run()
    finally:
        resumed.close()
    assert [m["step"] for m in rest] == [3]
    assert _stable(rest[0]) == pytest.approx(_stable(expected[2]), abs=1e-5)
