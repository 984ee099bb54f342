"""`tether agent ...` and `tether worker` end to end on the embedded back ends, and their error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.agents.scripts import write_script
from tether.cli.main import app

runner = CliRunner()


def invoke(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def test_agent_run_submits_follows_and_prints_the_timeline(tmp_path: Path) -> None:
    script = write_script(tmp_path / "s.jsonl", steps=2)
    code, output = invoke(
        "agent", "run", "append effects", "--model", f"scripted:{script}", "--home", str(tmp_path)
    )
    assert code == 0, output
    assert "step   0 [agent]" in output and "-> bash" in output and "echo effect-0 >> effects.log" in output
    assert "step   2 [agent]" in output and "-> finish" in output
    assert output.strip().splitlines()[-1].endswith("succeeded: ok")


def test_submit_then_a_worker_runs_it_and_ls_show_logs_report_it(tmp_path: Path) -> None:
    home = str(tmp_path)
    code, task_id = invoke("agent", "submit", "append effects", "--home", home)
    assert code == 0 and task_id.strip().startswith("t-")
    task_id = task_id.strip()
    code, listed = invoke("agent", "ls", "--json", "--home", home)
    assert json.loads(listed)[0]["status"] == "queued"
    script = write_script(tmp_path / "s.jsonl", steps=3)
    code, output = invoke(
        "worker",
        "--home",
        home,
        "--model",
        f"scripted:{script}",
        "--exit-when-idle",
        "--visibility-timeout-s",
        "5",
    )
    assert code == 0, output
    code, shown = invoke("agent", "show", task_id, "--json", "--home", home)
    record = json.loads(shown)
    assert record["status"] == "succeeded" and record["step_count"] == 4
    assert [step["step_no"] for step in record["steps"]] == [0, 1, 2, 3]
    assert record["steps"][0]["tool_calls"][0]["idempotency_key"] == f"{task_id}:0:0"
    code, logs = invoke("agent", "logs", task_id, "--home", home)
    assert code == 0 and [f" step {n:>3} [agent]" in logs for n in range(5)] == [True] * 4 + [False]
    assert logs.strip().endswith("succeeded: ok")
    code, followed = invoke("agent", "logs", task_id, "--follow", "--home", home)
    assert code == 0 and followed == logs  # a finished task's follow prints the same timeline and returns
    code, again = invoke("agent", "resume", task_id, "--home", home)
    assert code == 2 and "already succeeded" in again


def test_cancel_and_resume_a_queued_task(tmp_path: Path) -> None:
    home = str(tmp_path)
    task_id = invoke("agent", "submit", "g", "--home", home)[1].strip()
    code, output = invoke("agent", "cancel", task_id, "--home", home)
    assert code == 0 and output.strip() == f"{task_id} cancelled"
    assert (
        json.loads(invoke("agent", "ls", "--json", "--status", "cancelled", "--home", home)[1])[0]["task_id"]
        == task_id
    )
    assert invoke("agent", "resume", task_id, "--home", home)[0] == 0
    assert json.loads(invoke("agent", "show", task_id, "--json", "--home", home)[1])["status"] == "queued"


def test_bench_reports_step_persistence_under_five_ms_median() -> None:
    code, output = invoke("agent", "bench", "--steps", "200", "--json")
    assert code == 0, output
    result = json.loads(output)
    assert result["store"] == "sqlite" and result["steps"] == 200
    assert result["step_median_ms"] < 5.0, result


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["agent", "submit", "g", "--roles", "planner,hacker"], "unknown role(s) ['hacker']"),
        (["agent", "ls", "--status", "sleeping"], "--status 'sleeping': use one of queued"),
        (["agent", "show", "t-nope"], "no task 't-nope'"),
        (["agent", "logs", "t-nope"], "no task 't-nope'"),
        (["agent", "cancel", "t-nope"], "no task 't-nope'"),
        (["agent", "ls", "--store", "mysql://db"], "use sqlite:///PATH or postgresql://"),
        (["agent", "submit", "g", "--bus", "amqp://q"], "unknown scheme 'amqp'"),
        (["agent", "submit", "g", "--file", "/no/such/file.py"], "--file '/no/such/file.py' does not exist"),
        (["agent", "run", "g", "--model", "scripted:/no/such.jsonl"], "does not exist"),
        (
            ["worker", "--model", "scripted:x.jsonl", "--base-url", "http://h/v1"],
            "do not also give --base-url",
        ),
    ],
)
def test_bad_input_exits_with_a_clear_message(args: list[str], message: str, tmp_path: Path) -> None:
    code, output = invoke(*args, "--home", str(tmp_path))
    assert code == 2, output
    assert message in " ".join(output.split()), output


def test_submit_records_the_task_spec_from_the_flags(tmp_path: Path) -> None:
    home = str(tmp_path)
    strict = invoke(
        "agent", "submit", "g", "--roles", "planner,coder,reviewer", "--max-steps", "7", "--home", home
    )[1]
    loose = invoke("agent", "submit", "g", "--plain-reply-ends", "--home", home)[1]
    strict_spec = json.loads(invoke("agent", "show", strict.strip(), "--json", "--home", home)[1])["spec"]
    loose_spec = json.loads(invoke("agent", "show", loose.strip(), "--json", "--home", home)[1])["spec"]
    assert strict_spec["require_finish"] is True and loose_spec["require_finish"] is False
    assert [role["name"] for role in strict_spec["roles"]] == ["planner", "coder", "reviewer"]
    assert strict_spec["limits"]["max_steps"] == 7


def test_a_task_file_configures_custom_roles_and_flags_override_it(tmp_path: Path) -> None:
    template = tmp_path / "team.yaml"
    template.write_text(
        "roles:\n"
        "  - name: author\n    system_prompt: You write.\n    tools: [write_file, handoff]\n"
        "    hands_off_to: [critic]\n"
        "  - name: critic\n    system_prompt: You judge.\n    tools: [read_file, finish, handoff]\n"
        "    hands_off_to: [author]\n"
        "limits:\n  max_steps: 9\n  max_tokens: 5000\n"
    )
    home = str(tmp_path)
    task_id = invoke(
        "agent", "submit", "a poem", "--task-file", str(template), "--max-steps", "4", "--home", home
    )[1]
    spec = json.loads(invoke("agent", "show", task_id.strip(), "--json", "--home", home)[1])["spec"]
    assert [role["name"] for role in spec["roles"]] == ["author", "critic"]
    assert spec["roles"][0]["system_prompt"] == "You write." and spec["goal"] == "a poem"
    assert spec["limits"]["max_steps"] == 4 and spec["limits"]["max_tokens"] == 5000


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("roles: [{name: a, hands_off_to: [b]}]\n", "'a' hands off to 'b', which is not a role"),
        ("limits: {max_steps: 0}\n", "limits.max_steps = 0"),
        ("colour: blue\n", "unknown key 'colour'"),
        ("- just\n- a list\n", "must hold a mapping of task fields, not list"),
        ("roles: [\n", "is not valid YAML"),
    ],
)
def test_bad_task_files_are_explained(content: str, message: str, tmp_path: Path) -> None:
    template = tmp_path / "bad.yaml"
    template.write_text(content)
    code, output = invoke("agent", "submit", "g", "--task-file", str(template), "--home", str(tmp_path))
    assert code == 2, output
    assert message in " ".join(output.split()), output
