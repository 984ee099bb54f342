"""`tether eval`: episodes through the client `--model`/`--base-url` name, JSONL and summary outputs, the
progress lines, the reachability check of `--base-url`, and the errors a user can cause."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tether.cli.main import app

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tether.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=0)


def test_eval_runs_episodes_and_writes_jsonl_and_a_summary(tiny_model: Path, tmp_path: Path) -> None:
    args = ["eval", "--model", str(tiny_model), "--envs", "math/fractions,rg/basic_arithmetic", "-n", "2"]
    args += [
        "--max-tokens",
        "4",
        "--device",
        "cpu",
        "--kv-cache-mib",
        "16",
        "--out-dir",
        str(tmp_path),
        "--json",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["episodes"] == 4 and summary["errors"] == 0
    assert [row["env"] for row in summary["domains"]] == ["math/fractions", "rg/basic_arithmetic"]
    lines = Path(summary["episodes_file"]).read_text().splitlines()
    assert len(lines) == 4
    episode = json.loads(lines[0])
    assert {"score", "transcript", "completion_tokens", "sandbox_time_s"} <= set(episode)
    assert episode["transcript"][-1]["role"] == "assistant"
    assert json.loads(Path(summary["episodes_file"]).with_suffix(".json").read_text())["episodes"] == 4


def test_eval_off_a_terminal_prints_one_line_per_finished_episode(tiny_model: Path, tmp_path: Path) -> None:
    args = ["eval", "--model", str(tiny_model), "--envs", "math/fractions", "-n", "3", "--max-tokens", "2"]
    args += ["--device", "cpu", "--kv-cache-mib", "16", "--out-dir", str(tmp_path), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("episodes ")]
    assert [line.split(":")[0] for line in lines] == ["episodes 1/3", "episodes 2/3", "episodes 3/3"]
    assert all("math/fractions seed" in line and "reward" in line for line in lines)
    json.loads(result.stdout)  # the lines go to stderr: --json's stdout stays one object


def test_eval_against_a_dead_base_url_names_it_once_and_exits_non_zero(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/v1"
    args = ["eval", "--model", "m", "--envs", "math/fractions", "-n", "5", "--base-url", url]
    result = runner.invoke(app, [*args, "--out-dir", str(tmp_path)])
    assert result.exit_code == 2
    output = " ".join(result.output.split())
    assert output.count(url) == 1 and f"no server answers at {url}" in output
    assert "episode" not in output and not list(tmp_path.glob("*.jsonl"))


def test_eval_takes_a_mixture_file(tiny_model: Path, tmp_path: Path) -> None:
    mixture = tmp_path / "mix.toml"
    mixture.write_text('[weights]\n"math/fractions" = 3\n"math/powers" = 1\n')
    args = ["eval", "--model", str(tiny_model), "--envs", f"@{mixture}", "-n", "4", "--max-tokens", "2"]
    args += ["--device", "cpu", "--kv-cache-mib", "16", "--out-dir", str(tmp_path), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = {row["env"]: row["episodes"] for row in json.loads(result.stdout)["domains"]}
    assert rows == {"math/fractions": 3, "math/powers": 1}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--envs", "math/nope"], "unknown environment 'math/nope'"),
        (["--envs", "@/nonexistent/mix.toml"], "does not exist"),
        (["--envs", "math/fractions", "--device", "tpu"], "--device = 'tpu': expected auto, cpu, cuda"),
        (["--envs", "math/fractions", "-n", "0"], "Invalid value"),
    ],
)
def test_eval_user_errors_exit_2(extra: list[str], message: str, tmp_path: Path) -> None:
    result = runner.invoke(app, ["eval", "--model", "unused", "--out-dir", str(tmp_path), *extra])
    assert result.exit_code == 2
    assert message in result.output


def test_eval_replays_a_scripted_model_and_counts_its_tokens(tmp_path: Path) -> None:
    script = tmp_path / "replies.jsonl"
    script.write_text(json.dumps({"content": "<answer>1</answer>", "tool_calls": []}) + "\n")
    args = ["eval", "--model", f"scripted:{script}", "--envs", "math/fractions", "-n", "2"]
    result = runner.invoke(app, [*args, "--out-dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["episodes"] == 2 and summary["errors"] == 0
    episode = json.loads(Path(summary["episodes_file"]).read_text().splitlines()[0])
    assert episode["transcript"][-1] == {"role": "assistant", "content": "<answer>1</answer>"}
    assert episode["completion_tokens"] > 0  # the scripted client's usage is counted


def test_eval_names_a_missing_scripted_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    args = ["eval", "--model", f"scripted:{missing}", "--envs", "math/fractions", "--out-dir", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "does not exist" in " ".join(result.output.split())
