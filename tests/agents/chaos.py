"""The fault harness: real worker processes (`python -m tether.cli.worker`) SIGKILLed at random while
tasks run, then the journal and the final workdirs checked against an uninterrupted run."""

from __future__ import annotations

import io
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tether.store import ArtifactStore, Journal, TaskStatus


def snapshot_files(artifacts: ArtifactStore, key: str | None) -> dict[str, bytes]:
    assert key is not None
    with tarfile.open(fileobj=io.BytesIO(artifacts.get(key))) as archive:
        files = {}
        for member in archive.getmembers():
            extracted = archive.extractfile(member) if member.isfile() else None
            if extracted is not None:
                files[member.name.removeprefix("./")] = extracted.read()
        return files


@dataclass
class WorkerFleet:
    """Starts, kills and restarts worker processes; every process it starts, it also ends."""

    args: list[str]
    log_dir: Path
    size: int
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    kills: int = 0
    started: int = 0

    def _log(self, number: int) -> Path:
        return self.log_dir / f"worker-{number}.log"

    def wait_ready(self, number: int, timeout_s: float = 60.0) -> None:
        """Until worker `number` has started its sandbox pool: a loaded machine can take seconds, and
        killing workers faster than they start would test the machine, not the recovery."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and b"worker_ready" not in self._log(number).read_bytes():
            time.sleep(0.1)

    def _spawn(self) -> subprocess.Popen[bytes]:
        self.started += 1
        log = open(self._log(self.started), "wb")  # noqa: SIM115 - the child owns it
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(
            [sys.executable, "-m", "tether.cli.worker", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        log.close()
        return process

    def start(self) -> None:
        self.processes = [self._spawn() for _ in range(self.size)]
        for number in range(1, self.started + 1):
            self.wait_ready(number)

    def kill_one(self, rng: random.Random) -> None:
        index = rng.randrange(len(self.processes))
        victim = self.processes[index]
        if victim.poll() is None:
            victim.send_signal(signal.SIGKILL)
            self.kills += 1
        victim.wait()
        self.processes[index] = self._spawn()
        self.wait_ready(self.started)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for process in self.processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def run_with_chaos(
    journal: Journal,
    task_ids: list[str],
    fleet: WorkerFleet,
    kill_every_s: float,
    timeout_s: float,
    seed: int = 0,
) -> float:
    """Kill a random worker every `kill_every_s` until every task has ended; returns the seconds taken."""
    rng = random.Random(seed)
    start = time.monotonic()
    fleet.start()
    next_kill = start + kill_every_s
    try:
        while True:
            statuses = [journal.get_task(task_id).status for task_id in task_ids]
            if all(status.terminal for status in statuses):
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                pending = [t for t, s in zip(task_ids, statuses, strict=True) if not s.terminal]
                raise AssertionError(f"{len(pending)} task(s) unfinished after {timeout_s} s: {pending[:5]}")
            if time.monotonic() >= next_kill:
                fleet.kill_one(rng)
                next_kill = time.monotonic() + kill_every_s * rng.uniform(0.5, 1.5)
            time.sleep(0.2)
    finally:
        fleet.stop()


def assert_exactly_once(journal: Journal, task_ids: list[str], steps: int) -> dict[str, int]:
    """Every task succeeded with steps 0..steps, each once, every tool call observed once."""
    reexecuted = 0
    for task_id in task_ids:
        task = journal.get_task(task_id)
        assert task.status is TaskStatus.SUCCEEDED, f"{task_id}: {task.status} {task.error}"
        journal_steps = journal.steps(task_id)
        assert [step.step_no for step in journal_steps] == list(range(steps + 1)), task_id
        keys = [call.idempotency_key for step in journal_steps for call in step.tool_calls]
        assert len(keys) == len(set(keys)) == 2 * steps + 1
        for step in journal_steps:
            for call in step.tool_calls:
                assert call.observation is not None, call.idempotency_key
                assert call.executions >= 1
                reexecuted += call.executions - 1
    return {"tasks": len(task_ids), "reexecuted_calls": reexecuted}
