"""The demo's job: paired before/after comparison, held-out seeds, and a shrunken run on a tiny model."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from tether.envs.registry import default_registry, mixture_from_weights
from tether.errors import ConfigError
from tether.rl.demo import (
    ALL,
    DemoConfig,
    DemoSection,
    compare,
    comparison_table,
    eval_plans,
    load_demo_config,
    parse_demo_config,
    run_demo,
    training_seed_range,
)
from tether.rl.rollout import Rollout

from .fake_envs import fake_registry

SHIPPED = Path(__file__).parents[2] / "configs" / "demo.toml"


def rollout(env: str, seed: int, reward: float) -> Rollout:
    return Rollout(env, seed, 0, [1], [2], [-0.5], [0], "stop", reward=reward, passed=reward == 1.0)


def rollouts(env: str, rewards: list[list[float]]) -> list[Rollout]:
    """`rewards[i]` are the samples of task seed i."""
    return [rollout(env, seed, r) for seed, samples in enumerate(rewards) for r in samples]


def test_compare_pairs_prompts_and_reports_the_standard_error_of_the_gain() -> None:
    before = rollouts("a/x", [[0, 0], [0, 1]]) + rollouts("b/y", [[0, 0], [0, 0]])
    after = rollouts("a/x", [[1, 1], [0, 1]]) + rollouts("b/y", [[1, 1], [1, 1]])
    a, b, overall = compare(before, after)
    # a: per-prompt gains 1 and 0: mean 0.5, stdev sqrt(0.5), standard error sqrt(0.5) / sqrt(2) = 0.5.
    assert (a.env, a.prompts, a.samples) == ("a/x", 2, 2)
    assert (a.before, a.after, a.delta, a.stderr) == pytest.approx((0.25, 0.75, 0.5, 0.5))
    assert (a.before_pass, a.after_pass) == pytest.approx((0.25, 0.75))
    assert not a.clear  # 0.5 is within two standard errors (1.0)
    # b: the same gain of 1 on every prompt: no spread, a clear gain.
    assert (b.delta, b.stderr, b.clear) == (1.0, 0.0, True)
    # all: gains 1, 0, 1, 1: mean 0.75, stdev 0.5, standard error 0.25.
    assert overall.env == ALL
    assert (overall.delta, overall.stderr) == pytest.approx((0.75, 0.25))
    assert overall.clear
    assert overall.to_dict()["clear"] is True


def test_a_loss_is_never_a_clear_gain() -> None:
    before = rollouts("a/x", [[1, 1], [1, 1]])
    after = rollouts("a/x", [[0, 0], [0, 0]])
    row = compare(before, after)[0]
    assert row.delta == -1.0 and not row.clear


@pytest.mark.parametrize(
    ("before", "after", "message"),
    [
        (rollouts("a/x", [[0], [1]]), rollouts("a/x", [[0], [1], [1]]), "same (environment, seed)"),
        (rollouts("a/x", [[0], [1]]), rollouts("a/x", [[0, 1], [1, 1]]), "same number of samples"),
        (rollouts("a/x", [[0, 1]]), rollouts("a/x", [[1, 1]]), "standard error needs 2"),
    ],
)
def test_compare_refuses_evaluations_that_do_not_pair(
    before: list[Rollout], after: list[Rollout], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        compare(before, after)


def raw_config(**sections: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, dict[str, Any]] = {
        "envs": {"weights": {"test/vowels": 1.0, "test/digits": 1.0}, "seed_offset": 100},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 2},
        "run": {"steps": 5},
        "demo": {"prompts_per_domain": 3, "seed_offset": 1000},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def test_training_seeds_are_bounded_by_steps_times_prompts() -> None:
    config = parse_demo_config(raw_config())
    assert training_seed_range(config.train) == range(100, 120)


@pytest.mark.parametrize(
    ("offset", "ok"), [(0, True), (97, True), (98, False), (110, False), (119, False), (120, True)]
)
def test_held_out_seeds_must_miss_every_training_seed(offset: int, ok: bool) -> None:
    raw = raw_config(demo={"prompts_per_domain": 3, "seed_offset": offset})
    if ok:
        assert parse_demo_config(raw).demo.seed_offset == offset
    else:
        with pytest.raises(ConfigError, match=rf"demo.seed_offset = {offset}: held-out seeds .* overlap"):
            parse_demo_config(raw)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"demo": {"episodes": 3}}, "unknown key 'demo.episodes'; known keys: "),
        ({"demo": {"prompts_per_domain": 1}}, "demo.prompts_per_domain = 1"),
        ({"demo": {"temperature": -1.0}}, "demo.temperature = -1.0"),
        ({"demo": {"temperature": 0.0, "samples_per_prompt": 2}}, "greedy samples are identical"),
        ({"run": {"backend": "ray"}}, "run.backend = 'ray': the demo evaluates"),
        ({"rollout": {"backend": "ray"}}, "rollout.backend = 'ray': the demo evaluates"),
        ({"rollout": {"max_new_tokens": 0}}, "rollout.max_new_tokens = 0"),
    ],
)
def test_bad_demo_configs_name_the_key_and_what_is_accepted(
    sections: dict[str, dict[str, Any]], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_demo_config(raw_config(**sections), "demo.toml")


def test_a_demo_key_that_is_not_a_table_is_refused() -> None:
    with pytest.raises(ConfigError, match="demo = 3: expected a \\[demo\\] table"):
        parse_demo_config({**raw_config(), "demo": 3})


def test_missing_and_malformed_config_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_demo_config(tmp_path / "absent.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[demo\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_demo_config(broken)


def test_the_shipped_demo_mixes_three_families_one_of_them_sandboxed() -> None:
    config = load_demo_config(SHIPPED)
    names = mixture_from_weights(default_registry(), config.train.envs.weights).names
    assert len({name.split("/")[0] for name in names}) >= 3
    assert "math/python_arithmetic" in names  # its reward runs the model's program in the sandbox
    assert config.train.model.name == "smollm2-135m-instruct"
    # No [demo] section: it is also a plain train config, and evaluates the way it trains.
    assert config.demo == DemoSection()
    assert config.eval_temperature == config.train.rollout.temperature
    assert config.eval_max_new_tokens == config.train.rollout.max_new_tokens


def test_evaluation_sampling_follows_training_unless_set() -> None:
    trained = parse_demo_config(raw_config(rollout={"temperature": 0.7, "max_new_tokens": 40}))
    assert (trained.eval_temperature, trained.eval_max_new_tokens) == (0.7, 40)
    greedy = parse_demo_config(
        raw_config(demo={"temperature": 0.0, "samples_per_prompt": 1, "max_new_tokens": 9})
    )
    assert (greedy.eval_temperature, greedy.eval_max_new_tokens) == (0.0, 9)


def test_eval_plans_take_held_out_seeds_in_every_domain_with_fixed_sampling_seeds() -> None:
    section = DemoSection(prompts_per_domain=3, seed_offset=500, seed=4)
    plans = eval_plans(["a/x", "b/y"], section)
    assert [(p.env, p.seed, p.group) for p in plans] == [
        ("a/x", 500, 0),
        ("a/x", 501, 1),
        ("a/x", 502, 2),
        ("b/y", 500, 3),
        ("b/y", 501, 4),
        ("b/y", 502, 5),
    ]
    assert plans == eval_plans(["a/x", "b/y"], section)
    assert len({p.sample_seed for p in plans}) == 6
    other = eval_plans(["a/x", "b/y"], section.model_copy(update={"seed": 5}))
    assert {p.sample_seed for p in plans}.isdisjoint(p.sample_seed for p in other)


def tiny_demo(model: Path, out_dir: Path) -> DemoConfig:
    return parse_demo_config(
        raw_config(
            model={"name": str(model), "kv_cache_mib": 8},
            envs={"weights": {"test/vowels": 1.0, "test/digits": 1.0}, "seed_offset": 0},
            rollout={"prompts_per_step": 3, "samples_per_prompt": 2, "max_new_tokens": 6},
            optim={"lr": 1e-3, "micro_batch": 6},
            run={"name": "demo", "out_dir": str(out_dir), "steps": 2, "checkpoint_every": 100, "seed": 3},
            demo={"prompts_per_domain": 2, "samples_per_prompt": 2, "seed_offset": 50, "humaneval": False},
        )
    )


def test_tiny_demo_evaluates_held_out_seeds_with_the_initial_then_the_trained_policy(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    config = tiny_demo(tiny_model("qwen3"), tmp_path)
    phases: list[str] = []
    steps: list[float] = []
    result = run_demo(
        config, registry=fake_registry(), on_step=lambda m: steps.append(m["step"]), on_phase=phases.append
    )
    assert steps == [1.0, 2.0] and len(result.history) == 2
    assert [phase.split(":")[0] for phase in phases] == [
        "held-out evaluation before training",
        "training",
        "held-out evaluation after training",
    ]
    # Before: only the initial weights (version 0); after: only the weights of the last update.
    assert result.versions_before == [0] and result.versions_after == [2]
    assert result.held_out_seeds == {"test/vowels": [50, 51], "test/digits": [50, 51]}
    run_dir = tmp_path / "demo"
    assert result.run_dir == run_dir
    trained = [json.loads(line) for line in (run_dir / "transcripts.jsonl").read_text().splitlines()]
    assert trained and all(row["seed"] < 50 for row in trained)
    assert (run_dir / "report.html").is_file() and (run_dir / "config.toml").is_file()
    # The report states in dollars what the training rollouts would cost at the gateway, exactly.
    cost = json.loads((run_dir / "cost.json").read_text())
    assert cost["steps"] == 2 and Decimal(cost["cost/standard_usd_total"]) > 0
    page = (run_dir / "report.html").read_text()
    assert f"<td>standard</td><td>${cost['cost/standard_usd_total']}</td>" in page
    assert f"<td>fast</td><td>${cost['cost/fast_usd_total']}</td>" in page
    assert not (run_dir / "checkpoints").exists()  # checkpoint_every > steps: the demo keeps none
    assert [row.env for row in result.comparisons] == ["test/vowels", "test/digits", ALL]
    for row in result.comparisons:
        assert 0.0 <= row.before <= 1.0 and 0.0 <= row.after <= 1.0 and math.isfinite(row.stderr)
    payload = json.loads(json.dumps(result.to_dict()))
    assert payload["steps"] == 2 and len(payload["train_reward"]) == 2
    assert set(payload["timings_s"]) == {"load_s", "eval_before_s", "train_s", "eval_after_s", "total_s"}
    assert comparison_table(result).row_count == 3
