"""`tether sim`: one JSON object with every policy side by side, a plot, and clear input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tether.cli.main import app
from tether.scheduler.trace import SyntheticTrace, save_trace

runner = CliRunner()

SMALL_CLUSTER = "[[node_groups]]\ncount = 8\naccelerators = 8\nnodes_per_rack = 4\n"


def test_sim_prints_one_json_object_and_writes_the_plot(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(SMALL_CLUSTER)
    result = runner.invoke(
        app,
        [
            "sim",
            "--cluster",
            str(cluster),
            "--synthetic",
            "400",
            "--json",
            "--out-dir",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert list(payload["policies"]) == ["fifo", "fifo-backfill", "priority", "fair-share", "topology"]
    fifo, topo = payload["policies"]["fifo"], payload["policies"]["topology"]
    assert payload["jct_ratio_topology_vs_fifo"] == pytest.approx(
        topo["avg_jct_s"] / fifo["avg_jct_s"], abs=1e-3
    )
    assert payload["max_policy_wall_s"] == max(p["wall_s"] for p in payload["policies"].values())
    assert payload["cluster"]["accelerators"] == 64
    assert json.loads(Path(payload["json_path"]).read_text()) == payload
    assert Path(payload["plot_path"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sim_runs_a_trace_file_and_shows_a_table(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    save_trace(SyntheticTrace(jobs=200, seed=4).generate(), trace)
    result = runner.invoke(
        app, ["sim", "--trace", str(trace), "--policy", "fifo,topology", "--out-dir", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert "avg JCT" in result.output and "topology vs fifo average JCT" in result.output


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--synthetic", "10", "--policy", "lifo"], "unknown policy 'lifo'"),
        ([], "give exactly one of --trace FILE or --synthetic N"),
        (["--synthetic", "10", "--trace", "x.json"], "give exactly one of"),
        (["--trace", "/nonexistent.json"], "does not exist"),
        (["--synthetic", "10", "--cluster", "/nonexistent.toml"], "does not exist"),
        (["--synthetic", "10", "--load", "0"], "load = 0"),
        (["--synthetic", "10", "--cross-island-slowdown", "0.5"], "cross_island_slowdown"),
    ],
)
def test_bad_sim_input_exits_2_with_a_message(tmp_path: Path, args: list[str], expected: str) -> None:
    result = runner.invoke(app, ["sim", "--out-dir", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert expected in result.output


def test_sim_refuses_a_job_the_cluster_cannot_hold(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text('[{"job_id": "big", "submit_s": 0, "duration_s": 10, "replicas": 9, "accelerators": 1}]')
    cluster = tmp_path / "one.yaml"
    cluster.write_text("node_groups:\n  - {count: 1, accelerators: 8}\n")
    result = runner.invoke(
        app, ["sim", "--trace", str(trace), "--cluster", str(cluster), "--out-dir", str(tmp_path)]
    )
    assert result.exit_code == 2
    assert "job big: 9 replicas" in result.output


@pytest.mark.slow
def test_acceptance_10000_jobs_on_1024_accelerators(tmp_path: Path) -> None:
    result = runner.invoke(app, ["sim", "--synthetic", "10000", "--json", "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["cluster"]["accelerators"] == 1024
    assert payload["max_policy_wall_s"] < 60
    assert payload["jct_ratio_topology_vs_fifo"] <= 0.7
