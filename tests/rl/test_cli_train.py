"""`tether train`: a tiny run end to end through the CLI, resuming it, and every misuse named."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from tether.cli.main import app
from tether.cli.train import step_progress, step_view
from tether.rl.config import parse_config

runner = CliRunner()


def _write_config(path: Path, model: Path, out_dir: Path, steps: int = 2) -> Path:
    path.write_text(
        f"""
[model]
name = "{model}"
kv_cache_mib = 8

[envs.weights]
"math/arithmetic" = 1.0
"structured/person" = 1.0

[rollout]
prompts_per_step = 2
samples_per_prompt = 2
max_new_tokens = 6

[optim]
lr = 1e-4

[run]
name = "cli"
out_dir = "{out_dir}"
steps = {steps}
checkpoint_every = 1
"""
    )
    return path


def test_train_writes_the_run_directory_and_resume_continues(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    config = _write_config(tmp_path / "train.toml", tiny_model("llama"), tmp_path / "runs")
    result = runner.invoke(app, ["train", "--config", str(config)])
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "runs" / "cli"
    assert "step 2/2" in result.output
    assert "math/arithmetic" in result.output or "structured/person" in result.output
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert (run_dir / "config.toml").is_file() and (run_dir / "checkpoints" / "latest").is_file()
    assert "Steps recorded: 2." in (run_dir / "report.html").read_text()
    # The run's own config, with more steps, continues from step 2.
    text = (run_dir / "config.toml").read_text().replace("steps = 2", "steps = 3")
    (run_dir / "config.toml").write_text(text)
    result = runner.invoke(app, ["train", "--resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert lines[-1]["policy_version"] == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train"], "give exactly one of --config"),
        (["train", "--config", "a.toml", "--resume", "runs/x"], "give exactly one of --config"),
        (["train", "--config", "/nonexistent/train.toml"], "does not exist"),
        (["train", "--resume", "/nonexistent/run"], "does not exist"),
    ],
)
def test_misuse_exits_non_zero_with_a_message(args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    assert message in " ".join(result.output.split())


def test_unknown_environment_is_named(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    config = _write_config(tmp_path / "train.toml", tiny_model("llama"), tmp_path / "runs")
    config.write_text(config.read_text().replace('"math/arithmetic"', '"math/nope"'))
    result = runner.invoke(app, ["train", "--config", str(config)])
    assert result.exit_code != 0
    assert "unknown environment 'math/nope'" in " ".join(result.output.split())


def test_train_off_a_terminal_prints_one_line_per_step(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    config = _write_config(tmp_path / "train.toml", tiny_model("llama"), tmp_path / "runs", steps=3)
    result = runner.invoke(app, ["train", "--config", str(config)])
    assert result.exit_code == 0, result.output
    steps = [line.split("  ")[0] for line in result.output.splitlines() if line.startswith("cli step ")]
    assert steps == ["cli step 1/3", "cli step 2/3", "cli step 3/3"]


def test_step_progress_off_a_terminal_prints_each_step_and_phase_as_it_happens() -> None:
    config = parse_config({"envs": {"weights": {"math/arithmetic": 1.0}}, "run": {"name": "r", "steps": 5}})
    out = Console(file=io.StringIO(), force_terminal=False, width=80)
    with step_progress(config, "waiting", out) as (on_step, on_phase):
        on_phase("training: 5 steps")
        on_step(BASE_METRICS)
        lines = out.file.getvalue().splitlines()  # type: ignore[attr-defined]
        assert lines[:2] == ["waiting", "training: 5 steps"]
        assert lines[2].startswith("r step 2/5  reward 0.250  pass 25.0%")
        assert lines[2].endswith("9.0 s  (math/arithmetic 0.250)")
        assert len(lines) == 3  # one line per step however wide: a log's line is not wrapped


def test_each_step_shows_the_threads_it_ran_with() -> None:
    config = parse_config({"envs": {"weights": {"math/arithmetic": 1.0}}, "run": {"name": "r", "steps": 5}})
    out = Console(file=io.StringIO(), force_terminal=False, width=80)
    with step_progress(config, "waiting", out) as (on_step, _):
        on_step({**BASE_METRICS, "run/threads": 1.0})
        on_step({**BASE_METRICS, "step": 3.0, "run/threads": 2.0})
    lines = out.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert lines[1].endswith("9.0 s on 1 thread  (math/arithmetic 0.250)")
    assert lines[2].endswith("9.0 s on 2 threads  (math/arithmetic 0.250)")
    assert "push 0.10s on 2 threads" in _view_text({**BASE_METRICS, "run/threads": 2.0})


def test_the_demo_config_gets_past_environment_resolution(tmp_path: Path) -> None:
    # bench/integer_arithmetic is built in for `tether train` too; the run then stops at the model.
    shipped = (Path(__file__).parents[2] / "configs" / "demo.toml").read_text()
    missing = tmp_path / "no-such-model"
    config = tmp_path / "demo.toml"
    config.write_text(shipped.replace('name = "smollm2-135m-instruct"', f'name = "{missing}"'))
    result = runner.invoke(app, ["train", "--config", str(config)])
    assert result.exit_code != 0
    output = " ".join(result.output.split())
    assert "unknown environment" not in output
    assert f"unknown model '{missing}'" in output


def test_a_typo_in_a_config_environment_suggests_the_name_meant(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    config = _write_config(tmp_path / "train.toml", tiny_model("llama"), tmp_path / "runs")
    config.write_text(config.read_text().replace('"structured/person"', '"bench/integer_arithmetc"'))
    result = runner.invoke(app, ["train", "--config", str(config)])
    assert result.exit_code != 0
    assert "'bench/integer_arithmetc' (did you mean bench/integer_arithmetic?)" in " ".join(
        result.output.split()
    )


def _view_text(metrics: dict[str, float]) -> str:
    config = parse_config({"envs": {"weights": {"math/arithmetic": 1.0}}, "run": {"steps": 5}})
    console = Console(record=True, width=200)
    console.print(step_view(config, metrics))
    return console.export_text()


BASE_METRICS = {
    "step": 2.0,
    "reward": 0.25,
    "pass_rate": 0.25,
    "tokens_per_s": 40.0,
    "staleness_mean": 0.5,
    "staleness_max": 1.0,
    "time/step_s": 9.0,
    "time/generate_s": 5.0,
    "time/score_s": 0.5,
    "time/learn_s": 3.0,
    "time/push_s": 0.1,
    "domain/math/arithmetic/rollouts": 4.0,
    "domain/math/arithmetic/reward": 0.25,
    "domain/math/arithmetic/pass_rate": 0.25,
    "domain/math/arithmetic/response_tokens": 30.0,
    "domain/math/arithmetic/truncation_rate": 0.0,
    "domain/math/arithmetic/sandbox_s": 0.0,
}


def test_live_view_shows_step_rewards_throughput_time_split_and_staleness() -> None:
    text = _view_text(BASE_METRICS)
    assert "step 2/5" in text and "40 tok/s" in text and "staleness 0.50 (max 1)" in text
    assert "generate 5.0s + score 0.5s + learn 3.0s" in text
    assert "math/arithmetic" in text and "0.250" in text


def test_live_view_of_an_async_step_separates_waiting_from_overlapped_generation() -> None:
    text = _view_text({**BASE_METRICS, "time/wait_s": 1.5})
    assert "wait 1.5s + learn 3.0s" in text
    assert "rollout thread: generate 5.0s + score 0.5s" in text


def test_live_view_prints_the_logprob_gap_and_the_ratio_spread() -> None:
    metrics = {
        **BASE_METRICS,
        "learner/max_logprob_diff": 3e-6,
        "learner/compared_tokens": 96.0,
        "learner/ratio_min": 0.97,
        "learner/ratio_max": 1.05,
        "learner/ratio_std": 0.02,
    }
    text = _view_text(metrics)
    assert "logprob diff 3.0e-06 over 96 tokens" in text
    assert "ratio 0.970..1.050 (std 2.0e-02)" in text


def test_live_view_shows_infra_failures_and_retries_only_when_a_step_had_them() -> None:
    assert "infra-failed" not in _view_text({**BASE_METRICS, "rollout/infra_failed": 0.0})
    metrics = {
        **BASE_METRICS,
        "rollout/infra_failed": 2.0,
        "rollout/infra_failed/sandbox_error": 1.0,
        "rollout/infra_failed/scorer_timeout": 1.0,
        "rollout/retried": 5.0,
    }
    shown = " ".join(_view_text(metrics).split())  # the headline wraps at the console's width
    assert "infra-failed 2 (sandbox_error, scorer_timeout), retried 5" in shown


def test_live_view_shows_the_step_cost_and_warns_of_monitors_over_their_threshold() -> None:
    metrics = {
        **BASE_METRICS,
        "tokens/prompt_cached": 400.0,
        "tokens/prompt_uncached": 600.0,
        "tokens/output": 250.0,
        "cost/standard_usd": 0.003527,
        "cost/fast_usd": 0.007054,
        "sandbox/cpu_s": 1.25,
        "monitor/math/arithmetic/exploit_reward_share": 0.4,
        "monitor/math/arithmetic/qc_violation_rate": 0.0,
    }
    text = _view_text(metrics)
    assert "cost $0.003527 standard, $0.007054 fast: 1000 prompt tokens (400 cached) + 250 output" in text
    assert "sandbox CPU 1.25s" in text
    assert "warning: math/arithmetic: exploit_reward_share 0.400 > 0.1" in text
    assert "qc_violation_rate" not in text  # under its threshold: no warning
    assert "warning" not in _view_text(BASE_METRICS)
