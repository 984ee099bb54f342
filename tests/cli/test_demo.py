"""`tether demo`: a shrunken demo end to end through the CLI on a tiny model, and its misuses named."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from typer.testing import CliRunner

from tether.cli.main import app

runner = CliRunner()


def write_demo(path: Path, model: Path, demo_seed_offset: int = 1000) -> Path:
    path.write_text(
        f"""
[model]
name = "{model}"
kv_cache_mib = 8

[envs.weights]
"bench/integer_arithmetic" = 1.0
"math/arithmetic" = 1.0

[rollout]
prompts_per_step = 2
samples_per_prompt = 2
max_new_tokens = 6

[optim]
lr = 1e-4

[run]
name = "tiny-demo"
steps = 1
checkpoint_every = 10

[demo]
prompts_per_domain = 2
samples_per_prompt = 2
seed_offset = {demo_seed_offset}
humaneval = false
"""
    )
    return path


def test_demo_prints_the_table_and_writes_its_results(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    config = write_demo(tmp_path / "demo.toml", tiny_model("llama"))
    result = runner.invoke(app, ["demo", "--config", str(config), "--out-dir", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())  # rich wraps long lines at the runner's width
    assert "held-out evaluation before training: 4 prompts" in output
    assert "held-out reward" in output and "results written to" in output
    # Off a terminal (a log, `make demo | tee`): each phase and each training step as a line of its own.
    lines = result.output.splitlines()
    phases = [line for line in lines if line.startswith(("held-out evaluation", "training:"))]
    assert phases == [
        "held-out evaluation before training: 4 prompts",
        "training: 1 steps",
        "held-out evaluation after training",
    ]
    [step] = [line for line in lines if re.match(r"tiny-demo-\S+ step 1/1  reward", line)]
    assert lines.index(phases[1]) < lines.index(step) < lines.index(phases[2])
    [run_dir] = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("tiny-demo-")  # a fresh run directory per invocation
    payload = json.loads((run_dir / "demo.json").read_text())
    assert payload["humaneval"] is None  # switched off in [demo]
    assert [row["env"] for row in payload["held_out"]] == [
        "bench/integer_arithmetic",
        "math/arithmetic",
        "all",
    ]
    assert payload["policy_versions"] == {"before": [0], "after": [1]}
    assert payload["wall_s"] > 0
    report = (run_dir / "report.html").read_text()  # the held-out table heads the report
    assert report.index("Held-out evaluation before and after 1 RL steps") < report.index("<img")


def test_a_missing_demo_config_is_named(tmp_path: Path) -> None:
    result = runner.invoke(app, ["demo", "--config", str(tmp_path / "absent.toml")])
    assert result.exit_code == 2
    output = " ".join(result.output.split())
    assert "absent.toml" in output and "does not exist" in output


def test_held_out_seeds_that_overlap_training_fail_before_any_model_loads(tmp_path: Path) -> None:
    config = write_demo(tmp_path / "demo.toml", tmp_path / "no-model", demo_seed_offset=1)
    result = runner.invoke(app, ["demo", "--config", str(config)])
    assert result.exit_code == 2
    output = " ".join(result.output.split())
    assert "demo.seed_offset = 1: held-out seeds 1..2 overlap the training seeds 0..1" in output
