"""`tether train`: a tiny run end to end through the CLI, resuming it, and every misuse named."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tether.cli.main import app

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
