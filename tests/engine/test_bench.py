"""The engine benchmark: a shrunk run on a tiny model proves its shape and greedy parity with transformers;
the full SmolLM2 run (marked slow) holds the issue's thresholds."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from tether.cli import engine as engine_cli
from tether.engine.bench import BenchConfig, run_bench
from tether.errors import ConfigError
from tether.machine import machine_record
from tether.models import configure_threads, pull
from tether.testing import make_tiny_model

FIGURES = (
    "throughput_tok_s",
    "hf_throughput_tok_s",
    "throughput_speedup",
    "prefix_ttft_ms",
    "cold_ttft_ms",
    "prefix_speedup",
    "int8_throughput_tok_s",
    "int8_speedup",
    "int8_ppl_delta",
    "spec_throughput_tok_s",
    "spec_speedup",
    "acceptance_rate",
)
# The real model lives in the repository's cache, as for tests/models (its conftest pulls it the same way).
REPO_CACHE = Path(__file__).resolve().parents[2] / ".tether" / "cache"
SMOLLM2 = "smollm2-135m-instruct"
SPEEDUPS = ("throughput_speedup", "prefix_speedup", "int8_speedup", "spec_speedup")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configure_threads()
    return make_tiny_model(tmp_path_factory.mktemp("bench"), "llama")


def tiny_config(folder: Path) -> BenchConfig:
    return BenchConfig(
        model=folder,
        requests=6,
        min_output=2,
        max_output=8,
        hf_batch_size=4,
        prefix_tokens=64,
        repeats=2,
        kv_cache_mib=8,
        spec_max_output=8,
    )


def check_result(result: dict[str, Any]) -> None:
    for key in FIGURES:
        assert isinstance(result[key], float) and math.isfinite(result[key]), (key, result[key])
    for key in SPEEDUPS:
        assert result[key] > 0, (key, result[key])
    assert result["greedy_match"] == 1.0
    assert result["spec_greedy_match"] == 1.0, "greedy speculative decoding must equal plain decoding"
    assert 0 <= result["acceptance_rate"] <= 1
    assert result["prefix_cached_tokens"] >= result["prefix_tokens"]


def test_shrunk_bench_reports_every_figure_and_matches_transformers(tiny_folder: Path) -> None:
    result = run_bench(tiny_config(tiny_folder))
    check_result(result)
    assert result["output_tokens"] >= result["requests"] * 2
    assert abs(result["int8_ppl_delta"]) < 0.05 * result["float_ppl"]


def test_cli_prints_one_json_object_and_writes_it_to_out(tiny_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    root = typer.Typer()
    root.add_typer(engine_cli.app, name="engine")
    args = ["engine", "bench", "--model", str(tiny_folder), "--requests", "4", "--max-output", "4"]
    args += ["--min-output", "2", "--prefix-tokens", "32", "--repeats", "1", "--spec-max-output", "4"]
    args += ["--json", "--out", str(out)]
    outcome = CliRunner().invoke(root, args)
    assert outcome.exit_code == 0, outcome.output
    printed = json.loads(outcome.stdout.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())
    assert printed["requests"] == 4 and printed["greedy_match"] == 1.0
    assert machine_record(1, 0.0).keys() <= printed["machine"].keys()
    assert printed["freed_memory_kept"] is (platform.libc_ver()[0] == "glibc")
    assert printed["machine"]["torch_cpu_capability"] and printed["machine"]["threads"] == printed["threads"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("requests", 0, "requests = 0"),
        ("repeats", -1, "repeats = -1"),
        ("max_output", 1, "max_output = 1: expected at least min_output"),
        ("prefix_tokens", True, "prefix_tokens = True"),
        ("kv_cache_mib", 0, "kv_cache_mib = 0"),
        ("spec_tokens", 0, "spec_tokens = 0"),
        ("lanes", 0, "lanes = 0"),
        ("threads", True, "threads = True"),
    ],
)
def test_bad_bench_config_is_refused_naming_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BenchConfig(**{field: value})  # type: ignore[arg-type]


def test_cli_exits_non_zero_on_a_bad_option(tiny_folder: Path) -> None:
    root = typer.Typer()
    root.add_typer(engine_cli.app, name="engine")
    outcome = CliRunner().invoke(root, ["engine", "bench", "--model", str(tiny_folder), "--requests", "0"])
    assert outcome.exit_code == 2
    assert "requests = 0" in outcome.output


@pytest.mark.slow
def test_full_smollm2_bench_meets_the_issue_thresholds() -> None:
    result = run_bench(BenchConfig(model=pull(SMOLLM2, REPO_CACHE)))
    check_result(result)
    assert result["throughput_speedup"] >= 4, result
    assert result["prefix_speedup"] >= 5, result
    assert result["spec_speedup"] >= 1.5, result
