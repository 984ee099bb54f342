"""`tether rl bench`: the task and its reward, bad settings, a tiny tether-only run through the CLI, and
(slow) TRL's GRPOTrainer in the same invocation."""

from __future__ import annotations

import importlib
import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tether.cli.main import app
from tether.envs import bench as bench_task
from tether.errors import ConfigError
from tether.machine import machine_record
from tether.rl.bench import all_informative, run_bench, speedups
from tether.rl.bench_config import PHASES, BenchConfig, StepTimes
from tether.rl.bench_trl import run_trl

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
        ("threads", 0, r"threads = 0: expected an integer >= 1"),
        ("informative_repeats", 0, r"informative_repeats = 0"),
        ("max_probes", 0, r"max_probes = 0"),
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
    args += ["--steps", "2", "--prompts", "2", "--samples", "2", "--max-new-tokens", "4", "--no-informative"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed == json.loads(out.read_text())
    assert printed["batch"] == {"prompts": 2, "samples": 2, "max_new_tokens": 4}
    assert "trl" not in printed and "step_speedup_vs_trl" not in printed and "informative" not in printed
    assert printed["adapt_threads"] is False and printed["bench_s"] > 0
    assert printed["freed_memory_kept"] is (platform.libc_ver()[0] == "glibc")
    assert machine_record(1, 0.0).keys() <= printed["machine"].keys()
    assert printed["machine"]["threads"] == printed["torch_threads"]
    for name in RUNS:
        run = printed[name]
        assert len(run["steps_s"]) == len(run["reward"]) == 3  # one warm-up step, two measured
        assert run["step_s"] > 0 and 0 <= run["generate_fraction"] <= 1
        assert all(0 <= z <= 1 for z in run["zero_advantage_fraction"])


def odd_code_sum(completion: str, reference: str) -> float:
    """A reward a tiny random model scores mixed on: the parity of its random text's code points."""
    return float(sum(map(ord, completion)) % 2)


def test_the_informative_step_is_the_probed_batch_with_every_group_mixed(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bench task's reward is (almost) always 0 for a random model: this one is mixed, so the
    # probe has prompts to find, and the timed steps must reproduce what it saw.
    monkeypatch.setattr(bench_task, "reward", odd_code_sum)
    out = tmp_path / "bench.json"
    args = ["rl", "bench", "--model", str(tiny_model("llama")), "--no-trl", "--json", "--out", str(out)]
    args += ["--steps", "1", "--warmup-steps", "0", "--prompts", "3", "--samples", "2"]
    args += ["--max-new-tokens", "6", "--informative-repeats", "1", "--threads", "1"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    informative = printed["informative"]
    assert informative["groups"] == 3 and len(informative["task_seeds"]) == 6  # steps 0 and 1
    assert informative["probed_prompts"] >= 6
    for name in RUNS:
        assert informative[name]["informative_groups"] == [3]
        assert informative[name]["zero_advantage_fraction"] == [0.0]  # the learner skipped nothing
    assert informative["all_groups_informative"] is True
    for name in RUNS:  # where the informative step's time went, phase by phase
        (phases,) = informative[name]["steps_phases_s"]
        assert set(phases) == {*PHASES, "other_s"}
        assert sum(phases.values()) == pytest.approx(informative[name]["step_s"], abs=1e-3)
        assert phases["forward_s"] > 0 and phases["backward_s"] > 0 and phases["optimizer_s"] > 0
        assert phases["weight_sync_s"] > 0  # async: generation overlapped; its wait may round to 0
        assert phases["recompute_s"] == 0.0  # on-policy: the engine's logprobs, no old-policy forward
        assert informative[name]["phases_s"] == phases  # one timed step: its phases are the medians
    sync_phases = informative["tether_sync"]["steps_phases_s"][0]
    assert sync_phases["generate_s"] > 0 and sync_phases["score_s"] > 0
    assert printed["torch_threads"] == 1
    assert not any(key.startswith("informative_") for key in printed)  # no TRL: no ratio


def run(step_s: float, cpu_s: float, informative: list[int]) -> dict[str, Any]:
    return {"step_s": step_s, "cpu_s": cpu_s, "informative_groups": informative}


def test_the_speedups_are_trl_seconds_over_tethers() -> None:
    runs = {"tether_sync": run(2.0, 4.0, [8]), "tether_async": run(1.0, 5.0, [8]), "trl": run(6.0, 10.0, [7])}
    assert speedups(runs) == {"step": 3.0, "step_async": 6.0, "cpu": 2.5, "cpu_async": 2.0}
    assert speedups({name: runs[name] for name in RUNS}) == {}


@pytest.mark.parametrize(
    ("sync", "asynchronous", "valid"), [([8, 8], [8], True), ([8, 7], [8], False), ([8], [0], False)]
)
def test_the_informative_figure_is_valid_only_when_every_timed_tether_group_was_mixed(
    sync: list[int], asynchronous: list[int], valid: bool
) -> None:
    informative = {
        "groups": 8,
        "tether_sync": run(1.0, 1.0, sync),
        "tether_async": run(1.0, 1.0, asynchronous),
        "trl": run(1.0, 1.0, [3]),  # TRL samples its own completions: not required
    }
    assert all_informative(informative) is valid


def test_cli_bench_refuses_bad_settings() -> None:
    result = runner.invoke(app, ["rl", "bench", "--samples", "1", "--no-trl"])
    assert result.exit_code == 2
    assert "samples = 1" in result.output


@pytest.mark.slow
def test_trl_runs_in_the_same_invocation_and_the_speedup_is_reported(
    tiny_model: Callable[[str], Path],
) -> None:
    pytest.importorskip("trl")
    config = BenchConfig(
        model=str(tiny_model("llama")), prompts=2, samples=2, max_new_tokens=4, steps=2, informative=False
    )
    result = run_bench(config)
    assert len(result["trl"]["steps_s"]) == 3
    assert result["step_speedup_vs_trl"] == pytest.approx(
        result["trl"]["step_s"] / result["tether_sync"]["step_s"]
    )


def test_a_steps_phases_sum_to_its_time_the_rest_counted_as_other() -> None:
    times = StepTimes()
    times.add_phases(2.0, {"generate_s": 0.5, "forward_s": 0.25, "backward_s": 0.75})
    times.add_phases(4.0, {"generate_s": 1.5, "forward_s": 0.25, "backward_s": 0.75, "optimizer_s": 1.0})
    first, second = times.phases
    assert first["other_s"] == pytest.approx(0.5) and first["score_s"] == 0.0
    assert sum(first.values()) == pytest.approx(2.0) and sum(second.values()) == pytest.approx(4.0)
    with pytest.raises(AssertionError, match="unknown phases"):
        times.add_phases(1.0, {"sampling_s": 1.0})
