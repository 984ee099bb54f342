"""`tether rl bench`: the task and its reward, bad settings, a tiny tether-only run through the CLI, and
(slow) TRL's GRPOTrainer in the same invocation."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tether.cli.main import app
from tether.errors import ConfigError
from tether.machine import machine_record
from tether.rl.bench import BenchConfig, run_bench, run_trl

runner = CliRunner()
RUNS = ("tether_sync", "tether_async")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("prompts", 0, r"prompts = 0: expected an integer >= 1"),
        ("samples", 1, r"samples = 1: GRPO needs >= 2"),
        ("steps", 0, r"steps = 0: expected an integer >= 1"),
        ("max_new_tokens", 0, r"max_new_tokens = 0"),
        ("warmup_steps", -1, r"warmup_steps = -1"),
        ("lr", 0.0, r"lr = 0.0: expected a learning rate"),
    ],
)
def test_bad_bench_settings_are_refused_with_the_value(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BenchConfig(**{field: value})


def test_missing_trl_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = importlib.import_module

    def without_trl(name: str, package: str | None = None) -> Any:
        if name == "trl":
            raise ImportError("No module named 'trl'")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", without_trl)
    with pytest.raises(ConfigError, match=r"TRL is not installed .*--no-trl"):
        run_trl(BenchConfig(), tmp_path, lambda _: None)


def test_cli_bench_on_a_tiny_model_prints_one_json_object_and_writes_it(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    args = ["rl", "bench", "--model", str(tiny_model("llama")), "--no-trl", "--json", "--out", str(out)]
    args += ["--steps", "2", "--prompts", "2", "--samples", "2", "--max-new-tokens", "4"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed == json.loads(out.read_text())
    assert printed["batch"] == {"prompts": 2, "samples": 2, "max_new_tokens": 4}
    assert "trl" not in printed and "step_speedup_vs_trl" not in printed
    assert machine_record(1, 0.0).keys() <= printed["machine"].keys()
    assert printed["machine"]["threads"] == printed["torch_threads"]
    for name in RUNS:
        run = printed[name]
        assert len(run["steps_s"]) == len(run["reward"]) == 3  # one warm-up step, two measured
        assert run["step_s"] > 0 and 0 <= run["generate_fraction"] <= 1
        assert all(0 <= z <= 1 for z in run["zero_advantage_fraction"])


def test_cli_bench_refuses_bad_settings() -> None:
    result = runner.invoke(app, ["rl", "bench", "--samples", "1", "--no-trl"])
    assert result.exit_code == 2
    assert "samples = 1" in result.output


@pytest.mark.slow
def test_trl_runs_in_the_same_invocation_and_the_speedup_is_reported(
    tiny_model: Callable[[str], Path],
) -> None:
    pytest.importorskip("trl")
    config = BenchConfig(model=str(tiny_model("llama")), prompts=2, samples=2, max_new_tokens=4, steps=2)
    result = run_bench(config)
    assert len(result["trl"]["steps_s"]) == 3
    assert result["step_speedup_vs_trl"] == pytest.approx(
        result["trl"]["step_s"] / result["tether_sync"]["step_s"]
    )
