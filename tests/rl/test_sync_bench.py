"""`tether rl bench-sync`: bad settings, a tiny-model smoke run through the CLI (two Ray engine actors take
a version by each path, every one checked), and (slow) SmolLM2's weights, where the collective broadcast
must beat Ray's object store in the same run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tether.cli.main import app
from tether.errors import ConfigError
from tether.rl.sync_bench import PATHS, SyncBenchConfig, run_sync_bench

runner = CliRunner()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("engines", 0, r"engines = 0: expected an integer >= 1"),
        ("repeats", 0, r"repeats = 0: expected an integer >= 1"),
        ("warmup", -1, r"warmup = -1: expected an integer >= 0"),
        ("learner_steps", -1, r"learner_steps = -1: expected an integer >= 0"),
        ("object_store_mib", 0.5, r"object_store_mib = 0.5"),
        ("device", "tpu", r"bench-sync device = 'tpu': expected auto, cpu, cuda or cuda:N"),
        ("backend", "nccl", r"backend = 'nccl' needs the engines on CUDA: add --device cuda"),
    ],
)
def test_bad_bench_sync_settings_are_refused_with_the_value(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SyncBenchConfig(**{field: value})


def test_bad_collective_settings_are_refused_before_any_engine_starts() -> None:
    with pytest.raises(ConfigError, match=r"backend = 'mpi': expected one of 'gloo', 'nccl'"):
        SyncBenchConfig(backend="mpi")
    with pytest.raises(ConfigError, match=r"bucket_mib = -1: expected a finite number > 0"):
        SyncBenchConfig(bucket_mib=-1)


def test_cli_smoke_run_times_every_path_on_two_engines_and_prints_one_json_object(tmp_path: Path) -> None:
    out = tmp_path / "sync.json"
    result = runner.invoke(app, ["rl", "bench-sync", "--smoke", "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed == json.loads(out.read_text())
    assert printed["engines"] == 2 and printed["repeats"] == 1
    for path in PATHS:
        assert printed[f"{path}_s"] > 0 and len(printed["seconds"][path]) == 1
    speedup = printed["object_store_s"] / printed["collective_s"]
    assert printed["collective_speedup_vs_object_store"] == pytest.approx(speedup)
    # The sharded learner, one step on the same batch single and as 2 gloo ranks: equal, half the memory.
    assert printed["learner_steps"] == 1
    assert printed["fsdp2_max_abs_diff_vs_single"] < 1e-5
    assert printed["rank_memory_ratio_2_vs_1"] <= 0.55
    machine = printed["machine"]
    assert machine["threads"] == 2 and machine["cpu"] and isinstance(machine["busy_warnings"], list)
    assert machine["load_average_start"] >= 0 and machine["load_average_end"] >= 0


@pytest.mark.slow
def test_smollm2_weights_reach_two_engines_faster_by_collective_than_by_object_store() -> None:
    result = run_sync_bench(SyncBenchConfig())
    assert result["bytes"] > 500 * 2**20
    assert result["collective_s"] < result["object_store_s"], result
    assert result["fsdp2_max_abs_diff_vs_single"] < 1e-5
    assert result["rank_memory_ratio_2_vs_1"] <= 0.55
