"""Ctrl-C on `tether agent run`, for real: the command in its own process group, SIGINT sent to the whole
group as a terminal does, a scripted model whose every step takes a while in the sandbox."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from tests.agents.chaos import snapshot_files
from tests.agents.scripts import expected_effects
from tether.store import StepStatus, TaskStatus
from tether.store.artifacts import ArtifactStore
from tether.store.journal import Journal

TETHER = [sys.executable, "-c", "from tether.cli.main import app; app(prog_name='tether')"]


def slow_script(path: Path, seconds: list[float]) -> Path:
    """Step n sleeps `seconds[n]` in the sandbox, then appends its marker (a re-run would show twice)."""
    lines = [
        {
            "content": f"step {n}",
            "tool_calls": [
                {"name": "shell", "arguments": {"command": f"sleep {s}; echo effect-{n} >> effects.log"}}
            ],
        }
        for n, s in enumerate(seconds)
    ]
    lines.append({"content": "all done", "tool_calls": [{"name": "finish", "arguments": {"summary": "ok"}}]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


class Command:
    """A running `tether ...`, its output lines collected as they come."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [*TETHER, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a process group of its own, like a shell job
        )
        self.lines: queue.Queue[tuple[str, str]] = queue.Queue()
        self.seen: dict[str, list[str]] = {"out": [], "err": []}
        assert self.process.stdout is not None and self.process.stderr is not None
        self.pumps = [
            threading.Thread(target=self._pump, args=(name, stream), daemon=True)
            for name, stream in (("out", self.process.stdout), ("err", self.process.stderr))
        ]
        for pump in self.pumps:
            pump.start()

    def _pump(self, name: str, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put((name, line))

    def wait_for_line(self, text: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                name, line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            self.seen[name].append(line)
            if text in line:
                return
        raise AssertionError(f"no line with {text!r} within {timeout_s} s; saw {self.seen}")

    def ctrl_c(self) -> None:
        os.killpg(self.process.pid, signal.SIGINT)

    def finish(self, timeout_s: float) -> tuple[int, str, str]:
        code = self.process.wait(timeout=timeout_s)
        for pump in self.pumps:
            pump.join(timeout=5)  # they end at end of file
        while not self.lines.empty():
            name, line = self.lines.get()
            self.seen[name].append(line)
        return code, "".join(self.seen["out"]), " ".join("".join(self.seen["err"]).split())

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def commands() -> Iterator[list[Command]]:
    started: list[Command] = []
    yield started
    for command in started:
        command.kill()


def journal_of(home: Path) -> Journal:
    return Journal(f"sqlite:///{home / 'journal.db'}")


def task_id_in(output: str) -> str:
    first = output.splitlines()[0]
    assert first.startswith("task t-"), output
    return first.split()[1]


def test_ctrl_c_stops_agent_run_after_the_current_step_and_resume_continues_from_the_journal(
    tmp_path: Path, commands: list[Command]
) -> None:
    steps = 10
    script = slow_script(tmp_path / "slow.jsonl", [0.3] * steps)
    home = tmp_path / "home"
    run = Command("agent", "run", "append effects", "--model", f"scripted:{script}", "--home", str(home))
    commands.append(run)
    run.wait_for_line("step   1 [agent]")  # step 1 is journaled: its call is running now
    run.ctrl_c()
    interrupted_at = time.monotonic()
    code, output, errors = run.finish(timeout_s=30)
    assert code == 130, (output, errors)
    assert time.monotonic() - interrupted_at < 10, "Ctrl-C must not run the task on to its budget"
    assert "interrupted: stopping after the current step (Ctrl-C again to stop at once)" in errors
    task_id = task_id_in(output)
    assert f"task {task_id} is queued" in errors and f"tether agent resume {task_id} --run" in errors
    journal = journal_of(home)
    try:
        stopped = journal.steps(task_id)
        assert journal.get_task(task_id).status is TaskStatus.QUEUED
    finally:
        journal.close()
    assert all(step.status is StepStatus.COMMITTED for step in stopped)  # it stopped between steps
    assert 2 <= len(stopped) < steps, [step.step_no for step in stopped]
    assert f"stopped after step {len(stopped) - 1}:" in errors

    resumed = subprocess.run(
        [*TETHER, "agent", "resume", task_id, "--run", "--model", f"scripted:{script}", "--home", str(home)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert resumed.stdout.strip().endswith(f"task {task_id} succeeded: ok")
    assert f"step {len(stopped) - 1:>3} [agent]" in resumed.stdout  # the full timeline, old steps included
    journal = journal_of(home)
    try:
        final = journal.steps(task_id)
    finally:
        journal.close()
    assert [step.step_no for step in final] == list(range(steps + 1))
    assert final[: len(stopped)] == stopped  # the steps before Ctrl-C are the journal's, not redone
    assert all(call.executions == 1 for step in final for call in step.tool_calls if call.tool == "shell")
    files = snapshot_files(ArtifactStore(str(home / "artifacts")), final[-1].snapshot_key)
    assert files["effects.log"].decode() == expected_effects(steps)


def test_a_second_ctrl_c_stops_agent_run_at_once_and_leaves_the_task_resumable(
    tmp_path: Path, commands: list[Command]
) -> None:
    script = slow_script(tmp_path / "stuck.jsonl", [0.1, 40])
    home = tmp_path / "home"
    run = Command("agent", "run", "g", "--model", f"scripted:{script}", "--home", str(home))
    commands.append(run)
    run.wait_for_line("step   1 [agent]")  # step 1's `sleep 40` is running
    run.ctrl_c()
    run.wait_for_line("interrupted: stopping after the current step")
    run.ctrl_c()
    interrupted_at = time.monotonic()
    code, output, errors = run.finish(timeout_s=30)
    assert code == 130, (output, errors)
    assert time.monotonic() - interrupted_at < 10, "a second Ctrl-C must not wait for the step"
    task_id = task_id_in(output)
    assert f"stopped at once: task {task_id} resumes from its journal" in errors
    journal = journal_of(home)
    try:
        steps = journal.steps(task_id)
        assert not journal.get_task(task_id).status.terminal
    finally:
        journal.close()
    assert [step.status for step in steps] == [StepStatus.COMMITTED, StepStatus.PLANNED]

    queued = subprocess.run(
        [*TETHER, "agent", "resume", task_id, "--home", str(home)], capture_output=True, text=True, timeout=60
    )
    assert queued.returncode == 0 and queued.stdout.strip() == task_id, queued.stderr
    assert "it runs when a worker takes it" in queued.stderr


def test_ctrl_c_stops_a_worker_after_its_tasks_current_step(tmp_path: Path, commands: list[Command]) -> None:
    script = slow_script(tmp_path / "slow.jsonl", [0.3] * 10)
    home = tmp_path / "home"
    submitted = subprocess.run(
        [*TETHER, "agent", "submit", "g", "--home", str(home)], capture_output=True, text=True, timeout=60
    )
    task_id = submitted.stdout.strip()
    worker = Command("worker", "--model", f"scripted:{script}", "--home", str(home))
    commands.append(worker)
    worker.wait_for_line('"event": "step"')  # a step was committed; the next one is running
    worker.ctrl_c()
    code, _, errors = worker.finish(timeout_s=30)
    assert code == 0, errors
    assert "stopping: running tasks stop after their current step (again to stop at once)" in errors
    assert "worker stopped after finishing 0 task(s)" in errors
    journal = journal_of(home)
    try:
        assert journal.get_task(task_id).status is TaskStatus.QUEUED
        steps = journal.steps(task_id)
    finally:
        journal.close()
    assert 1 <= len(steps) < 10 and all(step.status is StepStatus.COMMITTED for step in steps)
