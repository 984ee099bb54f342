"""`tether jobs submit|ls|show|cancel` against a job store in a temporary directory."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tether.cli.main import app

runner = CliRunner()


def _jobs(db: Path, command: str, *args: str) -> dict[str, object]:
    result = runner.invoke(app, ["jobs", command, "--db", str(db), "--json", *args])
    assert result.exit_code == 0, result.output
    payload: dict[str, object] = json.loads(result.stdout)
    return payload


def test_submit_list_show_and_cancel(tmp_path: Path) -> None:
    db = tmp_path / "jobs.sqlite"
    submitted = _jobs(db, "submit", "--cpus", "0.5", "--name", "nap", "--", "sleep", "30")
    assert submitted["state"] == "running" and submitted["command"] == ["sleep", "30"]
    listing = _jobs(db, "ls")
    assert [job["name"] for job in listing["jobs"]] == ["nap"]  # type: ignore[index, union-attr]
    assert listing["policy"] == "fifo-backfill"
    shown = _jobs(db, "show", str(submitted["id"]))
    assert shown["pid"] == submitted["pid"]
    cancelled = _jobs(db, "cancel", str(submitted["id"]))
    assert cancelled["state"] == "cancelled"
    assert _jobs(db, "ls", "--state", "running")["jobs"] == []


def test_human_output_lists_jobs_in_a_table(tmp_path: Path) -> None:
    db = tmp_path / "jobs.sqlite"
    submitted = _jobs(db, "submit", "--", "true")
    deadline = time.monotonic() + 10
    while _jobs(db, "show", str(submitted["id"]))["state"] != "done" and time.monotonic() < deadline:
        time.sleep(0.05)
    listing = runner.invoke(app, ["jobs", "ls", "--db", str(db)])
    assert listing.exit_code == 0 and "done" in listing.output
    shown = runner.invoke(app, ["jobs", "show", str(submitted["id"]), "--db", str(db)])
    assert "log_path" in shown.output and "exit_code" in shown.output


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["submit", "--cpus", "100000", "--", "true"], "this machine has"),
        (["submit", "--", "/nonexistent/program"], "is not an executable file"),
        (["submit", "--policy", "lifo", "--", "true"], "unknown policy 'lifo'"),
        (["show", "7"], "no job with id 7"),
        (["cancel", "7"], "no job with id 7"),
    ],
)
def test_bad_job_commands_exit_2_with_a_message(tmp_path: Path, args: list[str], expected: str) -> None:
    result = runner.invoke(app, ["jobs", args[0], "--db", str(tmp_path / "jobs.sqlite"), *args[1:]])
    assert result.exit_code == 2, result.output
    assert expected in result.output


def test_an_unusable_store_path_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = runner.invoke(app, ["jobs", "ls", "--db", str(blocker / "jobs.sqlite")])
    assert result.exit_code == 2
    assert "cannot be opened" in result.output
