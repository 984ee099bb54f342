"""TrainConfig: TOML in, every bad value named with what would be accepted, and a faithful round trip."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tether.envs.registry import mixture_from_weights
from tether.errors import ConfigError
from tether.rl.advantages import AdvantageKind
from tether.rl.builders import training_registry
from tether.rl.config import dump_config, load_config, parse_config
from tether.rl.learner import lr_multiplier
from tether.rl.sections import Mode, Schedule

MINIMAL: dict[str, Any] = {"envs": {"weights": {"math/arithmetic": 1.0}}}


def test_minimal_config_takes_safe_defaults() -> None:
    config = parse_config(MINIMAL)
    assert config.run.mode is Mode.SYNC
    assert config.algorithm.advantage is AdvantageKind.GRPO
    assert config.run_dir == Path("runs/run")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "envs = {}: Field required"),
        ({"envs": {"weights": {}}}, "envs.weights = {}"),
        (
            {**MINIMAL, "optimizer": {}},
            "unknown key 'optimizer'; known keys: agents, algorithm, cost, envs, learner, model, monitors",
        ),
        ({**MINIMAL, "optim": {"learning_rate": 1}}, "unknown key 'optim.learning_rate'; known keys: beta1"),
        ({**MINIMAL, "optim": {"lr": -1}}, "optim.lr = -1: Input should be greater than 0"),
        ({**MINIMAL, "optim": {"micro_batch_tokens": 0}}, "optim.micro_batch_tokens = 0: Input should be"),
        ({**MINIMAL, "algorithm": {"advantage": "ppo"}}, "advantage = 'ppo': Input should be 'grpo'"),
        ({**MINIMAL, "algorithm": {"aggregation": "mean"}}, "algorithm.aggregation = 'mean'"),
        ({**MINIMAL, "algorithm": {"clip_low": 1.0}}, "clip_low = 1.0: Input should be less than 1"),
        ({**MINIMAL, "algorithm": {"tis_cap": 0.5}}, "algorithm.tis_cap = 0.5: Input should be greater than"),
        (
            {**MINIMAL, "algorithm": {"mismatch_correction": "seq"}},
            "mismatch_correction = 'seq': Input should",
        ),
        (
            {**MINIMAL, "algorithm": {"mismatch_cap": 0.9}},
            "algorithm.mismatch_cap = 0.9: Input should be greater",
        ),
        ({**MINIMAL, "rollout": {"samples_per_prompt": 0}}, "rollout.samples_per_prompt = 0"),
        ({**MINIMAL, "rollout": {"temperature": 0}}, "temperature = 0: Input should be greater than 0"),
        ({**MINIMAL, "rollout": {"infra_retries": -1}}, "rollout.infra_retries = -1: Input should"),
        ({**MINIMAL, "rollout": {"score_timeout_s": 0}}, "rollout.score_timeout_s = 0: Input should"),
        (
            {**MINIMAL, "rollout": {"max_infra_failure_rate": 1.5}},
            "rollout.max_infra_failure_rate = 1.5: Input should be less than or equal to 1",
        ),
        ({**MINIMAL, "algorithm": {"min_group_samples": 0}}, "algorithm.min_group_samples = 0: Input should"),
        ({**MINIMAL, "model": {"device": "gpu"}}, "model.device = 'gpu': String should match pattern"),
        ({**MINIMAL, "model": {"max_model_len": 0}}, "model.max_model_len = 0: Input should be greater"),
        (
            {**MINIMAL, "model": {"rope_scaling": "wavy:2"}},
            "model.rope_scaling = 'wavy:2': rope scaling type 'wavy' is not supported; accepted: default",
        ),
        ({**MINIMAL, "model": {"rope_scaling": "yarn:0"}}, "model.rope_scaling = 'yarn:0': rope scaling"),
        ({"envs": {"weights": {"math/arithmetic": 0.0}}}, "every weight must be a positive number"),
        ({"envs": {"weights": {"math/arithmetic": float("nan")}}}, "every weight must be a positive number"),
        ({**MINIMAL, "run": {"mode": "fast"}}, "run.mode = 'fast': Input should be 'sync' or 'async'"),
        ({**MINIMAL, "run": {"name": "../x"}}, "run.name = '../x': String should match pattern"),
        (
            {**MINIMAL, "algorithm": {"advantage": "rloo"}, "rollout": {"samples_per_prompt": 1}},
            "'rloo' needs rollout.samples_per_prompt >= 2",
        ),
        (
            {**MINIMAL, "algorithm": {"overlong_buffer_tokens": 65}},
            "overlong_buffer_tokens = 65 exceeds rollout.max_new_tokens = 64",
        ),
    ],
)
def test_bad_values_are_named(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=r"^config: ") as info:
        parse_config(raw)
    assert message in str(info.value)


def test_toml_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[envs\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)


def test_dump_reads_back_to_an_equal_config(tmp_path: Path) -> None:
    config = parse_config(
        {
            "model": {"name": 'we"ird', "cache_dir": "/tmp/c"},
            "envs": {"weights": {"rg/*": 2.0, "math/arithmetic": 0.5}, "seed_offset": 9},
            "algorithm": {"advantage": "dr_grpo", "drop_equal_groups": True, "clip_high": 0.28},
            "optim": {"schedule": "cosine", "warmup_steps": 3, "lr": 3e-5},
            "run": {"out_dir": "somewhere", "mode": "sync"},
        }
    )
    path = tmp_path / "config.toml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


@pytest.mark.parametrize("example", sorted((Path(__file__).parents[2] / "configs").glob("*.toml")))
def test_every_example_config_is_valid_and_names_only_registered_environments(example: Path) -> None:
    config = load_config(example)
    # What `tether train` resolves before any model loads: a typo here would stop the example there.
    assert mixture_from_weights(training_registry(config), config.envs.weights).names


@pytest.mark.parametrize(
    ("step", "schedule", "expected"),
    [
        (0, Schedule.CONSTANT, 0.5),  # warm-up: (0 + 1) / 2
        (1, Schedule.CONSTANT, 1.0),
        (7, Schedule.CONSTANT, 1.0),
        (2, Schedule.LINEAR, 1.0),  # decay starts after warm-up: 10 - 2 = 8 decay steps
        (6, Schedule.LINEAR, 0.5),
        (10, Schedule.LINEAR, 0.0),
        (6, Schedule.COSINE, 0.5),
        (10, Schedule.COSINE, 0.0),
    ],
)
def test_lr_schedule(step: int, schedule: Schedule, expected: float) -> None:
    assert lr_multiplier(step, warmup_steps=2, total_steps=10, schedule=schedule) == pytest.approx(expected)


def test_the_retired_bf16_key_says_what_replaced_it() -> None:
    with pytest.raises(
        ConfigError, match=r'model\.bf16 = True was replaced by model\.dtype: write dtype = "bfloat16"'
    ):
        parse_config({"model": {"bf16": True}, "envs": {"weights": {"math/*": 1.0}}})


def test_float16_with_a_sharded_learner_is_refused_when_the_config_is_read() -> None:
    raw = {
        "model": {"dtype": "float16"},
        "learner": {"strategy": "fsdp", "world_size": 2},
        "envs": {"weights": {"math/*": 1.0}},
    }
    with pytest.raises(ConfigError, match=r"model\.dtype = 'float16' with learner\.strategy = 'fsdp'"):
        parse_config(raw)


def test_max_model_len_and_rope_scaling_reach_the_engine_and_the_learner(
    tiny_model: Callable[[str], Path],
) -> None:
    """The tiny model has 2048 positions: 8192 tokens need its rope scaled, in the learner too (or its
    logprobs would not be the engine's)."""
    from tether.models.config import RopeScaling
    from tether.rl.builders import make_engine, make_learner

    model = {"name": str(tiny_model("qwen2")), "kv_cache_mib": 8, "max_model_len": 8192}
    config = parse_config({**MINIMAL, "model": {**model, "rope_scaling": "yarn:4"}})
    engine, _ = make_engine(config, "cpu")
    assert engine.config.max_model_len == 8192
    yarn = RopeScaling("yarn", 4.0, 2048)
    assert engine.runner.model.config.rope_scaling == yarn
    assert make_learner(config, "cpu").model.config.rope_scaling == yarn
    with pytest.raises(ConfigError, match="max_model_len 8,192 is past the model's context limit of 2,048"):
        make_engine(parse_config({**MINIMAL, "model": model}), "cpu")


@pytest.mark.parametrize(
    ("verifiers", "message"),
    [
        ({"add": {}}, "module"),
        ({"add": {"module": "vf_add", "reward_range": [1.0, 0.0]}}, "low < high"),
        ({"add": {"module": "vf_add", "max_turns": 0}}, "max_turns"),
        ({"a/b": {"module": "vf_add"}}, "becomes vf/NAME"),
        ({"add": {"module": "vf_add", "turns": 3}}, "turns"),
    ],
)
def test_bad_verifiers_envs_are_refused_when_the_config_is_read(
    verifiers: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"envs": {"weights": {"vf/add": 1.0}, "verifiers": verifiers}})
