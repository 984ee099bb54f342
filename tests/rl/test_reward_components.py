"""`[[rewards]]`: a judge or a reward model added to one domain of a mixture trains beside a programmatic
domain, reports its component and the judge's usage, survives config.toml, and bad tables fail clearly."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tether.envs.context import ScoringContext
from tether.errors import ConfigError
from tether.rl.builders import build_trainer, training_registry
from tether.rl.config import TrainConfig, dump_config, load_config, parse_config
from tether.testing import make_tiny_classifier

from .fake_envs import fake_registry

VERDICT = {"reason": "reads well", "score": 0.5}


def config_with(model: Path, out_dir: Path, *rewards: dict[str, Any]) -> TrainConfig:
    return parse_config(
        {
            "model": {"name": str(model), "kv_cache_mib": 8},
            "envs": {"weights": {"test/vowels": 1.0, "test/digits": 1.0}},
            "rollout": {"prompts_per_step": 4, "samples_per_prompt": 2, "max_new_tokens": 6},
            "optim": {"lr": 1e-3, "micro_batch": 8},
            "run": {"name": "rewards", "out_dir": str(out_dir), "steps": 2, "checkpoint_every": 2, "seed": 3},
            "rewards": list(rewards),
        }
    )


def train(config: TrainConfig) -> list[dict[str, float]]:
    trainer = build_trainer(config, registry=fake_registry())
    try:
        history = trainer.run()
    finally:
        trainer.close()
    assert [m["step"] for m in history] == [1, 2]
    # The run directory's config.toml reads back to the same config, [[rewards]] tables included.
    assert load_config(config.run_dir / "config.toml") == config
    return history


def judged(metrics: dict[str, float]) -> float:
    return metrics.get("domain/test/vowels/rollouts", 0.0)


@pytest.fixture
def verdicts(tmp_path: Path) -> Path:
    path = tmp_path / "verdicts.jsonl"
    path.write_text(json.dumps({"content": json.dumps(VERDICT)}) + "\n")
    return path


def test_a_judge_reward_trains_two_steps_beside_a_programmatic_domain(
    tiny_model: Callable[[str], Path], tmp_path: Path, verdicts: Path
) -> None:
    judge = {"kind": "judge", "model": f"scripted:{verdicts}", "envs": "test/vow*", "weight": 0.5}
    history = train(config_with(tiny_model("qwen3"), tmp_path, judge))
    assert sum(judged(m) for m in history) > 0 and sum(m["domain/test/digits/rollouts"] for m in history) > 0
    for metrics in history:
        assert "domain/test/digits/reward/judge" not in metrics  # only the domain the glob names
        if judged(metrics):
            assert metrics["domain/test/vowels/reward/judge"] == VERDICT["score"]
            assert metrics["judge/requests"] + metrics["judge/cache_hits"] == judged(metrics)
            assert metrics["judge/prompt_tokens"] > 0 and metrics["judge/cost_usd"] > 0
        assert metrics["learner/ratio_mean"] == pytest.approx(1.0, abs=1e-4)


def test_a_reward_model_trains_two_steps_beside_a_programmatic_domain(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = make_tiny_classifier(tmp_path / "rm", "qwen3")
    reward_model = {"kind": "reward_model", "path": str(folder), "envs": "test/vowels", "gate": True}
    history = train(config_with(tiny_model("qwen3"), tmp_path, reward_model))
    values = [m["domain/test/vowels/reward/reward_model"] for m in history if judged(m)]
    assert values and all(0.0 < value < 1.0 for value in values)
    assert all("domain/test/digits/reward/reward_model" not in m for m in history)


def test_the_components_travel_to_ray_rollout_workers_unopened(tmp_path: Path, verdicts: Path) -> None:
    cloudpickle = pytest.importorskip("cloudpickle")  # what Ray sends actors' arguments with
    folder = make_tiny_classifier(tmp_path / "rm", "llama")
    judge = {"kind": "judge", "model": f"scripted:{verdicts}", "envs": "test/vowels"}
    reward_model = {"kind": "reward_model", "path": str(folder), "envs": "test/*"}
    registry = training_registry(config_with(tmp_path, tmp_path, judge, reward_model), fake_registry())
    copy = cloudpickle.loads(cloudpickle.dumps(registry))
    vowels, digits = copy.get("test/vowels"), copy.get("test/digits")
    score = asyncio.run(vowels.score(vowels.task(0), "aeiou", ScoringContext()))
    assert score.components["judge"] == VERDICT["score"] and 0 < score.components["reward_model"] < 1
    assert digits.rubric.names == ["share", "short", "reward_model"]
    assert digits.rubric.passing == "share"  # an added component never changes what counts as passed


def test_every_rewards_setting_reads_back_from_the_run_directorys_config(tmp_path: Path) -> None:
    judge = {
        "kind": "judge",
        "name": "style",
        "base_url": "https://judge.example/v1",
        "model": "grader",
        "api_key_env": "JUDGE_KEY",
        "rubric": 'Grade "{answer}"\n\tfor {prompt}; reply {{"score": 1}}',
        "labels": {"good": 1.0, "bad": 0.0},
        "price": {"input_cache_miss_per_mtok": "0.25", "output_per_mtok": "1.5"},
        "weight": 0.25,
        "gate": True,
    }
    reward_model = {
        "kind": "reward_model",
        "path": str(tmp_path / "rm"),
        "logit_shift": -1.5,
        "positive_label": 1,
    }
    config = config_with(tmp_path, tmp_path, judge, reward_model)
    (tmp_path / "config.toml").write_text(dump_config(config))
    assert load_config(tmp_path / "config.toml") == config


@pytest.mark.slow
def test_a_judge_on_our_engine_in_process_answers_a_verdict_in_its_schema(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    # A random model, held to the verdict's grammar: the reason closes at its maxLength (8 characters,
    # at most 12 byte tokens each, a JSON-escaped surrogate pair), so 160 tokens always hold a whole
    # verdict. The fast version of this test is the scripted judge's.
    judge = {
        "kind": "judge",
        "model": str(tiny_model("qwen3")),
        "device": "cpu",
        "labels": {"yes": 1.0, "no": 0.0},
        "max_reason_chars": 8,
        "max_tokens": 160,
    }
    registry = training_registry(config_with(tmp_path, tmp_path, judge), fake_registry())
    env = registry.get("test/vowels")
    ctx = ScoringContext()
    score = asyncio.run(env.score(env.task(0), "aeiou", ctx))
    assert score.components["judge"] in (0.0, 1.0) and len(score.detail["judge_reason"]) <= 8
    counters = ctx.take_counters()
    assert counters["judge/requests"] == 1 and counters["judge/completion_tokens"] > 0


@pytest.mark.parametrize(
    ("table", "why"),
    [
        ({"kind": "critic"}, r"rewards\[0\]\.kind = 'critic'"),
        ({"kind": "judge"}, r"rewards\[0\]: rewards \(judge\): a judge needs model .* or base_url"),
        ({"kind": "judge", "model": "m", "path": "rm"}, "path is not read by kind = 'judge'"),
        ({"kind": "reward_model"}, "a reward model needs path"),
        ({"kind": "reward_model", "path": "rm", "rubric": "{answer}"}, "rubric is not read by kind"),
        ({"kind": "judge", "model": "m", "rubric": "{question}"}, r"unknown field\(s\) \{question\}"),
        ({"kind": "judge", "model": "m", "labels": {"good": 3}}, r"each scored in \[0, 1\]"),
        ({"kind": "judge", "model": "m", "api_key_env": "KEY"}, "api_key_env is read only with base_url"),
        ({"kind": "judge", "model": "m", "base_url": "judge:8000"}, r"rewards\[0\]\.base_url"),
        (
            {"kind": "judge", "model": "m", "colour": "red"},
            r"unknown key 'rewards\[0\]\.colour'; known keys: ",
        ),
        ({"kind": "judge", "model": "m", "name": "Judge"}, r"rewards\[0\]\.name = 'Judge'"),
    ],
)
def test_a_bad_rewards_table_is_a_config_error_naming_it(
    table: dict[str, Any], why: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=why):
        config_with(tmp_path, tmp_path, table)


@pytest.mark.parametrize(
    ("table", "why"),
    [
        (
            {"kind": "judge", "model": "scripted:VERDICTS", "envs": "math/*"},
            r"envs = 'math/\*' matches no environment of the mixture \(test/vowels, test/digits\)",
        ),
        (
            {"kind": "judge", "model": "scripted:VERDICTS", "name": "share"},
            "reward names must be unique.*give the component another name",
        ),
        (
            {"kind": "judge", "model": "scripted:missing.jsonl"},
            "model = 'scripted:missing.jsonl': no such file",
        ),
        (
            {"kind": "judge", "base_url": "http://judge:8000/v1", "api_key_env": "TETHER_TEST_UNSET_KEY"},
            "api_key_env = 'TETHER_TEST_UNSET_KEY' is not set",
        ),
        ({"kind": "reward_model", "path": "RM"}, "not a sequence classifier"),
    ],
)
def test_a_rewards_table_that_does_not_fit_the_run_fails_before_any_model_loads(
    table: dict[str, Any], why: str, tmp_path: Path, verdicts: Path, tiny_model: Callable[[str], Path]
) -> None:
    spelled = {
        key: str(value).replace("VERDICTS", str(verdicts)).replace("RM", str(tiny_model("llama")))
        for key, value in table.items()
    }
    with pytest.raises(ConfigError, match=why):
        training_registry(config_with(tmp_path, tmp_path, spelled), fake_registry())


def test_a_positive_label_the_classifier_lacks_is_refused(tmp_path: Path) -> None:
    folder = make_tiny_classifier(tmp_path / "rm", "llama", num_labels=2)
    table = {"kind": "reward_model", "path": str(folder), "positive_label": 2}
    with pytest.raises(ConfigError, match=r"positive_label = 2 but the classifier has 2 label\(s\) \(0..1\)"):
        training_registry(config_with(tmp_path, tmp_path, table), fake_registry())
