"""Rollouts from a server fleet (`RemoteRollouts`): `[rollout]`'s server settings are checked, a step's
prompts are spread over the servers and their tokens kept as they come, every server loads each version
(older safetensors folders deleted), and `tether train` runs on fake vLLM and SGLang servers behind real
sockets. Multi-turn environments are refused before any model loads. Servers that fail:
`test_server_failover.py`."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from tests.live_server import live_server
from tether.cli.main import app
from tether.envs.context import ScoringContext
from tether.errors import ConfigError
from tether.rl.builders import build_trainer
from tether.rl.config import TrainConfig, dump_config, parse_config
from tether.rl.remote_rollouts import server_rollouts
from tether.rl.rollout import PromptPlan
from tether.rl.trainer import sampling_params

from .fake_envs import fake_registry
from .fake_sglang import FakeSGLangState, create_fake_sglang
from .fake_vllm import FakeState, create_fake_vllm, logprob_of, token_of
from .test_cli_train import _write_config
from .test_episodes import registry as multi_turn_registry
from .test_trainer import tiny_config

ENVS = {"envs": {"weights": {"math/arithmetic": 1.0}}}


@pytest.mark.parametrize(
    ("run", "rollout", "message"),
    [
        ({}, {"backend": "vllm"}, "rollout.backend = 'vllm' needs rollout.base_urls"),
        ({}, {"backend": "sglang", "base_urls": []}, "rollout.backend = 'sglang' needs rollout.base_urls"),
        ({}, {"backend": "vllm", "base_urls": ["localhost:8000"]}, "rollout.base_urls ['localhost:8000']"),
        ({}, {"backend": "vllm", "base_urls": ["http://h:1/v1"]}, "expected http(s)://host[:port] roots"),
        ({}, {"backend": "vllm", "base_urls": ["ftp://h:1"]}, "expected http(s)://host[:port] roots"),
        ({}, {"backend": "vllm", "base_urls": ["http://h:1"] * 2}, "name each server once"),
        ({}, {"backend": "tgi"}, "rollout.backend = 'tgi': Input should be 'local', 'ray', 'vllm'"),
        ({}, {"backend": "vllm", "base_urls": ["http://h:1"], "timeout_s": 0}, "rollout.timeout_s = 0"),
        ({}, {"base_urls": ["http://h:1"]}, "rollout.base_urls is read only with rollout.backend = 'vllm'"),
        ({}, {"backend": "ray", "weights_dir": "w"}, "rollout.weights_dir is read only with rollout.backend"),
        ({}, {"backend": "vllm", "base_urls": ["http://h:1"], "api_key_env": "A-KEY"}, "rollout.api_key_env"),
        (
            {"backend": "ray"},
            {"backend": "local"},
            "rollout.backend = 'local' runs the engine in the learner",
        ),
        (
            {},
            {"backend": "vllm", "base_urls": ["http://h:1"], "weight_sync": "collective"},
            "rollout.weight_sync = 'collective' does not apply to rollout.backend = 'vllm', which accepts "
            "'auto', 'safetensors'",
        ),
        ({}, {"backend": "ray", "weight_sync": "safetensors"}, "which accepts 'auto', 'collective', 'obj"),
        ({}, {"weight_sync": "object_store"}, "rollout.backend = 'local', which accepts 'auto'"),
        ({}, {"backend": "ray", "weight_sync": "nccl"}, "rollout.weight_sync = 'nccl': Input should be"),
        ({}, {"backend": "ray", "sync_host": "h"}, "rollout.sync_host is read only with rollout.backend"),
    ],
)
def test_bad_rollout_backend_settings_are_named(
    run: dict[str, object], rollout: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({**ENVS, "run": run, "rollout": rollout})


@pytest.mark.parametrize(
    ("run", "rollout", "expected"),
    [({}, {}, "local"), ({"backend": "ray"}, {}, "ray"), ({}, {"backend": "ray"}, "ray")],
)
def test_rollouts_follow_run_backend_unless_rollout_backend_says_otherwise(
    run: dict[str, object], rollout: dict[str, object], expected: str
) -> None:
    assert parse_config({**ENVS, "run": run, "rollout": rollout}).rollout_backend == expected


@pytest.mark.parametrize(
    ("rollout", "expected"),
    [
        ({}, "auto"),
        ({"backend": "ray"}, "collective"),
        ({"backend": "ray", "weight_sync": "object_store"}, "object_store"),
        ({"backend": "sglang", "base_urls": ["http://h:1"]}, "collective"),
        ({"backend": "sglang", "base_urls": ["http://h:1"], "weight_sync": "safetensors"}, "safetensors"),
        ({"backend": "vllm", "base_urls": ["http://h:1"]}, "safetensors"),
    ],
)
def test_weight_sync_auto_resolves_to_each_backends_default(
    rollout: dict[str, object], expected: str
) -> None:
    config = parse_config({**ENVS, "rollout": rollout})
    assert config.weight_sync == expected
    assert parse_config(json.loads(json.dumps(config.model_dump(mode="json")))) == config


@pytest.fixture
def fleet() -> Iterator[list[tuple[FakeState, str]]]:
    """Two fake vLLM servers, each behind its own socket."""
    states = [FakeState(), FakeState()]
    with (
        live_server(create_fake_vllm(states[0])) as first,
        live_server(create_fake_vllm(states[1])) as second,
    ):
        yield [(states[0], first), (states[1], second)]


def _remote_config(
    model: Path, out_dir: Path, backend: str, urls: list[str], weight_sync: str = "auto", **run: object
) -> TrainConfig:
    rollout = {
        "backend": backend,
        "base_urls": urls,
        "served_model": "fake",
        "max_new_tokens": 6,
        "weight_sync": weight_sync,
    }
    return tiny_config(model, out_dir, rollout=rollout, run={"steps": 2, **run})


def test_a_step_is_spread_over_the_fleet_and_every_server_loads_each_version(
    tiny_model: Callable[[str], Path], tmp_path: Path, fleet: list[tuple[FakeState, str]]
) -> None:
    config = _remote_config(tiny_model("llama"), tmp_path, "vllm", [url for _, url in fleet])
    params = sampling_params(config.rollout)
    rollouts = server_rollouts(config, fake_registry(), ScoringContext(), params)
    plans = [PromptPlan("test/vowels", seed, group, 100 + group) for group, seed in enumerate(range(3))]
    try:
        out = rollouts.generate(plans)
        weights = [("model.norm.weight", torch.ones(8)), ("lm_head.weight", torch.zeros(4, 8))]
        rollouts.load(iter(weights), 1)
        rollouts.load(iter(weights), 1)  # a version's weights never change: loaded once
        rollouts.load(iter(weights), 2)
        after = rollouts.generate(plans[:1])
    finally:
        rollouts.close()
    first, second = (state for state, _ in fleet)
    # Prompts 0 and 2 went to the first server, prompt 1 to the second (concurrently: in any order),
    # each with its plan's seed; then prompt 0 again.
    assert sorted(r["seed"] for r in first.requests[:2]) == [100, 102] and first.requests[2]["seed"] == 100
    assert [r["seed"] for r in second.requests] == [101]
    assert len(out.rollouts) == 3 * config.rollout.samples_per_prompt
    for rollout in out.rollouts:
        sample = out.rollouts.index(rollout) % config.rollout.samples_per_prompt
        assert rollout.completion_ids == [token_of(rollout.prompt_ids, i, sample) for i in range(6)]
        assert rollout.logprobs == [logprob_of(0)] * 6 and rollout.versions == [0] * 6
        assert 0 <= rollout.reward <= 1 and "share" in rollout.components  # scored by the environment
    assert all(r.versions == [2] * 6 and r.logprobs == [logprob_of(2)] * 6 for r in after.rollouts)
    for state in (first, second):
        assert state.version == 2 and not state.paused  # both loads reached both servers, once each
        assert [Path(u["location"]).name for u in state.updates] == ["v1", "v2"]
    assert [p.name for p in (tmp_path / "tiny" / "weights").iterdir()] == ["v2"]


def test_the_api_key_comes_from_the_environment_variable_the_config_names(
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    fleet: list[tuple[FakeState, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = _remote_config(tiny_model("llama"), tmp_path, "vllm", [fleet[0][1]])
    config = config.model_copy(
        update={"rollout": config.rollout.model_copy(update={"api_key_env": "TEST_VLLM_KEY"})}
    )
    args = (config, fake_registry(), ScoringContext(), sampling_params(config.rollout))
    monkeypatch.delenv("TEST_VLLM_KEY", raising=False)
    with pytest.raises(
        ConfigError, match=re.escape("rollout.api_key_env = 'TEST_VLLM_KEY': that environment variable")
    ):
        server_rollouts(*args)
    monkeypatch.setenv("TEST_VLLM_KEY", "s3cret")
    rollouts = server_rollouts(*args)
    try:
        rollouts.generate([PromptPlan("test/vowels", 0, 0, 1)])
    finally:
        rollouts.close()
    assert fleet[0][0].authorizations == ["Bearer s3cret"]
    assert "s3cret" not in dump_config(config)


def test_train_command_runs_two_steps_on_a_vllm_server_and_resumes_on_it(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    state = FakeState()
    run_dir = tmp_path / "runs" / "cli"
    with live_server(create_fake_vllm(state)) as url:
        config = _write_config(tmp_path / "train.toml", tiny_model("llama"), tmp_path / "runs")
        config.write_text(
            config.read_text().replace(
                "max_new_tokens = 6", f'max_new_tokens = 6\nbackend = "vllm"\nbase_urls = ["{url}"]'
            )
        )
        result = CliRunner().invoke(app, ["train", "--config", str(config)])
        assert result.exit_code == 0, result.output
        assert "step 2/2" in result.output
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [(line["step"], line["policy_version"]) for line in lines] == [(1, 1), (2, 2)]
        assert all(line["generated_tokens"] == 2 * 2 * 6 for line in lines)  # the server's tokens, as sent
        assert state.version == 2 and [Path(u["location"]).name for u in state.updates] == ["v1", "v2"]
        assert state.requests[0]["model"] == str(tiny_model("llama"))  # served_model unset: model.name
        # The learner's parameter names, shapes and dtypes, as the server loaded them.
        assert "model.embed_tokens.weight" in state.updates[0]["names"]
        assert set(state.updates[0]["dtype_names"]) == {"float32"}
        assert [p.name for p in (run_dir / "weights").iterdir()] == ["v2"]  # v1 removed once v2 loaded
        assert 'backend = "vllm"' in (run_dir / "config.toml").read_text()
        # Resumed, the run first loads its checkpoint's version into the servers, then goes on.
        (run_dir / "config.toml").write_text(
            (run_dir / "config.toml").read_text().replace("steps = 2", "steps = 3")
        )
        result = CliRunner().invoke(app, ["train", "--resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert [Path(u["location"]).name for u in state.updates] == ["v1", "v2", "v2", "v3"]
    assert [p.name for p in (run_dir / "weights").iterdir()] == ["v3"]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["policy_version"] for line in lines] == [1, 2, 3]


@pytest.mark.parametrize("weight_sync", ["collective", "safetensors"])
def test_training_on_an_sglang_server_advances_its_weight_version(
    tiny_model: Callable[[str], Path], tmp_path: Path, weight_sync: str
) -> None:
    state = FakeSGLangState()
    with live_server(create_fake_sglang(state)) as url:
        config = _remote_config(tiny_model("qwen3"), tmp_path, "sglang", [url], weight_sync)
        trainer = build_trainer(config, registry=fake_registry())
        try:
            history = trainer.run()
            learned = dict(trainer.learner.weights())
        finally:
            trainer.close()
    assert [m["policy_version"] for m in history] == [1, 2]
    assert [u["weight_version"] for u in state.updates] == ["1", "2"] and state.weight_version == "2"
    # Batch 2 was generated by the server after it loaded version 1, and tagged so.
    transcripts = [
        json.loads(line) for line in (tmp_path / "tiny" / "transcripts.jsonl").read_text().splitlines()
    ]
    assert [t["policy_versions"] for t in transcripts] == [[0], [0], [1], [1]]
    if weight_sync == "safetensors":
        assert [p.name for p in (tmp_path / "tiny" / "weights").iterdir()] == ["v2"]
        return
    # Broadcast: the server received the learner's final weights, every byte, and nothing went to disk.
    assert not (tmp_path / "tiny" / "weights").exists() and list(state.received) == ["1", "2"]
    assert list(state.received["2"]) == list(learned)
    for name, tensor in learned.items():
        assert torch.equal(state.received["2"][name], tensor), name
    assert not torch.equal(state.received["1"][name], tensor)  # version 1's weights were another step's


def test_multi_turn_environments_on_servers_are_refused_before_any_model_loads(tmp_path: Path) -> None:
    raw: dict[str, Any] = {
        "model": {"name": str(tmp_path / "no-model-here")},
        "envs": {"weights": {"test/notes2": 1.0, "test/vowels": 1.0}},
        "rollout": {"backend": "vllm", "base_urls": ["http://127.0.0.1:9"]},
        "run": {"out_dir": str(tmp_path)},
    }
    message = (
        "rollout.backend = 'vllm' with multi-turn environments ['test/notes2']: its episodes run on our "
        "engine (tether/rl/episodes.py), not on vLLM or SGLang servers"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_trainer(parse_config(raw), registry=multi_turn_registry())


def test_async_mode_generates_ahead_on_a_server_within_the_staleness_bound(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    state = FakeState()
    with live_server(create_fake_vllm(state)) as url:
        config = _remote_config(
            tiny_model("qwen3"), tmp_path, "vllm", [url], steps=3, mode="async", max_staleness=1
        )
        trainer = build_trainer(config, registry=fake_registry())
        try:
            history = trainer.run()  # the rollout thread drives the server, the learner trains meanwhile
        finally:
            trainer.close()
    assert [m["staleness_max"] for m in history] == [0, 1, 1]  # batch s generated with max(0, s - 1)
    assert [Path(u["location"]).name for u in state.updates] == ["v1"] and state.version == 1
    assert [p.name for p in (tmp_path / "tiny" / "weights").iterdir()] == ["v1"]
