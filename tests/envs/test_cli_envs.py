"""`tether envs list|show|score` and `tether eval`: outputs, files written, and errors a user can cause."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tether.cli.main import app
from tether.envs.registry import default_registry

runner = CliRunner()


def test_list_shows_every_environment_and_the_count() -> None:
    result = runner.invoke(app, ["envs", "list"])
    assert result.exit_code == 0, result.output
    count = len(default_registry())
    assert f"{count} environments in" in result.output


def test_list_json_is_one_object_with_count_families_and_envs() -> None:
    result = runner.invoke(app, ["envs", "list", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["count"] == len(payload["envs"]) >= 100
    assert payload["families"] == len({env["family"] for env in payload["envs"]})
    first = payload["envs"][0]
    assert set(first) >= {"name", "family", "turns", "rewards"}


def test_list_filters_by_glob_and_refuses_a_glob_that_matches_nothing() -> None:
    result = runner.invoke(app, ["envs", "list", "math/*", "--json"])
    assert {env["family"] for env in json.loads(result.stdout)["envs"]} == {"math"}
    result = runner.invoke(app, ["envs", "list", "nope/*"])
    assert result.exit_code == 2 and "matches no environment" in result.output


def test_list_shows_the_bench_task_the_demo_trains_on() -> None:
    result = runner.invoke(app, ["envs", "list", "bench/*", "--json"])
    assert result.exit_code == 0, result.output
    assert [env["name"] for env in json.loads(result.stdout)["envs"]] == ["bench/integer_arithmetic"]


def test_a_pattern_that_matches_nothing_suggests_the_nearest_names() -> None:
    result = runner.invoke(app, ["envs", "list", "rg/leg_countin"])
    assert result.exit_code == 2
    assert "did you mean rg/leg_counting," in " ".join(result.output.split())


def test_show_prints_seeded_tasks_with_their_references() -> None:
    result = runner.invoke(app, ["envs", "show", "math/quadratic", "-n", "2", "--seed", "5", "--json"])
    assert result.exit_code == 0, result.output
    tasks = json.loads(result.stdout)["tasks"]
    assert [task["seed"] for task in tasks] == [5, 6]
    assert tasks[0]["reference_replies"][0]["content"] == f"<answer>{tasks[0]['reference']}</answer>"
    text = runner.invoke(app, ["envs", "show", "math/quadratic", "--seed", "5"])
    assert tasks[0]["reference"] in text.output and "system" in text.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["envs", "show", "math/nope"], "unknown environment 'math/nope'"),
        (["envs", "show", "noslash"], "unknown environment"),
        (["envs", "show", "math/fractions", "-n", "0"], "Invalid value"),
        (["envs", "score", "math/fractions", "--answer-file", "/nonexistent/answer.txt"], "answer.txt"),
        (["envs", "score", "math/fractions", "--seed", "-1"], "Invalid value"),
    ],
)
def test_user_errors_exit_2_with_a_clear_message(args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output


def test_score_shows_every_component_of_a_reference_and_of_a_wrong_answer(tmp_path: Path) -> None:
    task = default_registry().get("structured/order").task(4)
    answer = tmp_path / "answer.txt"
    answer.write_text(f"<answer>{task.reference}</answer>")
    result = runner.invoke(
        app, ["envs", "score", "structured/order", "--seed", "4", "--answer-file", str(answer), "--json"]
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["total"] == 1.0 and set(payload["components"]) == {
        "correctness",
        "schema",
        "fields",
        "format",
    }
    table = runner.invoke(
        app, ["envs", "score", "structured/order", "--seed", "4"], input="<answer>{}</answer>"
    )
    assert table.exit_code == 0 and "schema" in table.output and "total" in table.output


def test_score_plays_a_multi_turn_transcript_through_the_sandbox(tmp_path: Path) -> None:
    task = default_registry().get("finance/analyst").task(2)
    submit = {
        "id": "s",
        "type": "function",
        "function": {"name": "submit", "arguments": json.dumps({"answer": task.reference})},
    }
    answer = tmp_path / "replies.json"
    answer.write_text(json.dumps([{"content": "", "tool_calls": [submit]}]))
    result = runner.invoke(
        app, ["envs", "score", "finance/analyst", "--seed", "2", "--answer-file", str(answer), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["total"] == 1.0


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
