"""The `tether` command line: help everywhere, JSON outputs, exit codes and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from tether.cli.main import app

runner = CliRunner()


def _command_paths() -> list[list[str]]:
    paths: list[list[str]] = [[]]
    root = get_command(app)
    for name, command in root.commands.items():  # type: ignore[attr-defined]
        paths.append([name])
        for sub in getattr(command, "commands", {}):
            paths.append([name, sub])
    return paths


@pytest.mark.parametrize("path", _command_paths(), ids=lambda p: " ".join(p) or "tether")
def test_every_command_has_help(path: list[str]) -> None:
    result = runner.invoke(app, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_sandbox_run_prints_one_json_object(tmp_path: Path) -> None:
    program = tmp_path / "prog.py"
    program.write_text("import sys\nprint(sys.stdin.read().upper())\nsys.exit(4)\n")
    stdin = tmp_path / "in.txt"
    stdin.write_text("abc")
    result = runner.invoke(
        app, ["sandbox", "run", "--language", "python", "--stdin", str(stdin), str(program)]
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["status"] == "runtime_error"
    assert payload["exit_code"] == 4
    assert payload["stdout"] == "ABC\n"


def test_sandbox_run_reads_standard_input_and_applies_a_spec_file(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text("timeout_s = 1\nmemory_mib = 256\n")
    result = runner.invoke(app, ["sandbox", "run", "-l", "bash", "--spec", str(spec), "-"], input="sleep 5\n")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["status"] == "timeout"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["sandbox", "run", "--language", "cobol", "-"], "language 'cobol' is not supported"),
        (["sandbox", "run", "--spec", "/nonexistent.toml", "-"], "does not exist"),
        (["sandbox", "run", "--file", "no-equals-sign", "-"], "expected NAME=PATH"),
    ],
)
def test_bad_input_exits_non_zero_with_a_message(args: list[str], expected: str) -> None:
    result = runner.invoke(app, args, input="print(1)\n")
    assert result.exit_code == 2
    assert expected in result.output


def test_bad_spec_value_names_the_key(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text("memory_mib = 'lots'\n")
    result = runner.invoke(app, ["sandbox", "run", "--spec", str(spec), "-"], input="print(1)\n")
    assert result.exit_code == 2
    assert "memory_mib = 'lots'" in result.output


def test_config_show_reflects_environment() -> None:
    result = runner.invoke(app, ["config", "show"], env={"TETHER_SANDBOX__SPEC__TIMEOUT_S": "7"})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["sandbox"]["spec"]["timeout_s"] == 7


def test_config_show_rejects_a_bad_environment_value() -> None:
    result = runner.invoke(app, ["config", "show"], env={"TETHER_SANDBOX__SLOTS": "zero"})
    assert result.exit_code == 2
    assert "sandbox.slots = 'zero' (from environment)" in result.output


def test_humaneval_passes_canonical_and_fails_mutated() -> None:
    canonical = runner.invoke(app, ["sandbox", "humaneval", "--json"])
    assert canonical.exit_code == 0, canonical.output
    report = json.loads(canonical.stdout)
    assert (report["passed"], report["total"]) == (164, 164)
    assert report["wall_s"] < 10
    mutated = runner.invoke(app, ["sandbox", "humaneval", "--json", "--mutate"])
    assert mutated.exit_code == 0, mutated.output
    assert json.loads(mutated.stdout)["passed"] <= 2


def test_bench_reports_pool_and_fresh_figures(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = runner.invoke(
        app, ["sandbox", "bench", "--json", "--runs", "60", "--fresh-runs", "20", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    for key in (
        "pool_exec_per_s",
        "pool_p50_ms",
        "pool_p99_ms",
        "fresh_exec_per_s",
        "fresh_p50_ms",
        "fresh_p99_ms",
        "speedup",
    ):
        assert payload[key] > 0
    assert payload["speedup"] > 1.5
    assert json.loads(out.read_text()) == payload


def test_doctor_reports_every_primitive_available_here() -> None:
    result = runner.invoke(app, ["sandbox", "doctor", "--json"])
    assert result.exit_code == 0, result.output
    checks = {check["name"]: check["ok"] for check in json.loads(result.stdout)["checks"]}
    assert checks["user namespace"] and checks["seccomp filter"] and checks["cgroups (memory, pids, cpu)"]


def test_unknown_tether_variable_warns_once_and_the_command_runs() -> None:
    result = runner.invoke(
        app, ["config", "show"], env={"TETHER_BAR_SECRET": "1", "TETHER_LOG_LEVEL": "debug"}
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["log_level"] == "debug"
    assert result.stderr.count("ignoring environment variable TETHER_BAR_SECRET: not a tether setting") == 1
