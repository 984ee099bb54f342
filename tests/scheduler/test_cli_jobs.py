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


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--", "tether", "train"], "needs `--config FILE` or `--resume RUN_DIR`"),
        (["--", "tether", "train", "--config", "/nonexistent/x.toml"], "does not exist"),
        (
            ["--replicas", "2", "--", "tether", "eval", "x"],
            "the eval workload runs one process; replicas = 2",
        ),
        (["--workload", "serve", "--", "tether", "eval", "x"], "the serve workload runs `tether serve ...`"),
        (
            [
                "--workload",
                "sandbox-fleet",
                "--replicas",
                "2",
                "--",
                "tether",
                "sandbox",
                "serve",
                "--port",
                "1",
            ],
            "drop --port",
        ),
        (["--workload", "nope", "--", "true"], "'nope' is not one of"),
        (["--replicas", "0", "--", "true"], "replicas = 0: must be at least 1"),
        (["--stop-grace-s", "0", "--", "true"], "stop grace 0.0 s must be positive"),
        (["--max-restarts", "-1", "--", "true"], "max restarts -1 must be 0 or more"),
        (["--accelerators", "3", "--", "true"], "asks for 3 accelerators but this machine has 2"),
        (
            ["--accelerators", "1", "--replicas", "3", "--cpus", "0.1", "--", "true"],
            "asks for 3 accelerators but this machine has 2",
        ),
    ],
)
def test_bad_workloads_exit_2_with_a_message(tmp_path: Path, args: list[str], expected: str) -> None:
    db = str(tmp_path / "jobs.sqlite")
    result = runner.invoke(app, ["jobs", "--machine-accelerators", "2", "submit", "--db", db, *args])
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split())


def test_a_negative_machine_accelerator_count_is_refused(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["jobs", "--machine-accelerators", "-1", "ls", "--db", str(tmp_path / "j.sqlite")]
    )
    assert result.exit_code == 2 and "--machine-accelerators" in result.output


def test_a_sandbox_fleet_serves_each_instance_on_its_own_port(tmp_path: Path) -> None:
    import httpx

    db = tmp_path / "jobs.sqlite"
    fleet = _jobs(db, "submit", "--workload", "sandbox-fleet", "--replicas", "2", "--cpus", "0.5")
    assert fleet["command"] == ["tether", "sandbox", "serve"] and fleet["kind"] == "sandbox"
    ports = fleet["ports"]
    assert isinstance(ports, list) and len(set(ports)) == 2
    deadline, healthy = time.monotonic() + 60, set()
    while healthy != set(ports) and time.monotonic() < deadline:
        for port in set(ports) - healthy:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    healthy.add(port)
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    assert healthy == set(ports)
    assert _jobs(db, "cancel", str(fleet["id"]))["state"] == "cancelled"


def test_a_failing_service_is_restarted_up_to_its_limit(tmp_path: Path) -> None:
    db = tmp_path / "jobs.sqlite"
    service = _jobs(db, "submit", "--max-restarts", "1", "--", "tether", "serve", str(tmp_path / "no-model"))
    assert service["workload"] == "serve" and service["kind"] == "serve"
    deadline = time.monotonic() + 60
    while (shown := _jobs(db, "show", str(service["id"])))[
        "state"
    ] == "running" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (shown["state"], shown["restarts"], shown["attempts"]) == ("failed", 1, 1)
    log = Path(str(shown["log_path"])).read_text()
    assert log.count("tether: job 1 attempt 1 replica 0") == 2  # the first run and its restart
