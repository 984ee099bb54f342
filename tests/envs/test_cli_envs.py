"""`tether envs list|show|score`: outputs, files written, and errors a user can cause."""

from __future__ import annotations

import json
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


def write_verifiers_config(tmp_path: Path, module: str) -> Path:
    path = tmp_path / "train.toml"
    path.write_text(f'[envs.weights]\n"vf/add" = 1.0\n\n[envs.verifiers.add]\nmodule = "{module}"\n')
    return path


def test_list_show_and_score_see_the_verifiers_envs_of_a_train_config(tmp_path: Path) -> None:
    from tests.envs.verifiers_fixtures import install_module, single_turn_env

    install_module("vf_tether_cli_env", load_environment=single_turn_env)
    config = str(write_verifiers_config(tmp_path, "vf_tether_cli_env"))
    listed = runner.invoke(app, ["envs", "list", "vf/*", "--json", "--config", config])
    assert listed.exit_code == 0, listed.output
    (env,) = json.loads(listed.stdout)["envs"]
    assert env["name"] == "vf/add" and env["rewards"] == ["correct_answer", "format_reward_func", "brevity"]
    shown = runner.invoke(app, ["envs", "show", "vf/add", "-n", "1", "--json", "--config", config])
    assert json.loads(shown.stdout)["tasks"][0]["reference"] == "5"
    answer = "<think>\nadd\n</think>\n<answer>\n5\n</answer>"
    scored = runner.invoke(app, ["envs", "score", "vf/add", "--json", "--config", config], input=answer)
    assert scored.exit_code == 0, scored.output
    assert json.loads(scored.stdout)["components"]["correct_answer"] == 1.0


def test_a_verifiers_module_that_is_not_installed_is_a_user_error(tmp_path: Path) -> None:
    config = str(write_verifiers_config(tmp_path, "vf_tether_not_installed"))
    result = runner.invoke(app, ["envs", "list", "vf/*", "--config", config])
    assert result.exit_code == 2 and "'vf_tether_not_installed' is not installed" in result.output
