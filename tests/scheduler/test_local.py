"""The local back end with real processes: capacity accounting, queueing, cancel, preemption, reaping."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tether.errors import ConfigError
from tether.scheduler.job import JobState
from tether.scheduler.local import LocalBackend, MachineCapacity
from tether.scheduler.processes import alive, wait_group
from tether.scheduler.store import JobRecord, JobRequest

CAPACITY = MachineCapacity(cpus=2, memory_mib=1024)


def _wait(
    backend: LocalBackend, job_id: int, done: Callable[[JobRecord], bool], timeout_s: float = 15
) -> JobRecord:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = backend.get(job_id)
        if done(record):
            return record
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} stuck in {backend.get(job_id)}")


def _request(*command: str, cpus: float = 1, memory_mib: int = 128, **kwargs: object) -> JobRequest:
    return JobRequest(command=command, cwd=str(Path.cwd()), cpus=cpus, memory_mib=memory_mib, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def backend(tmp_path: Path) -> LocalBackend:
    return LocalBackend.open(tmp_path / "jobs.sqlite", capacity=CAPACITY)


def test_a_job_runs_logs_and_records_its_exit(backend: LocalBackend) -> None:
    record = backend.submit(_request("sh", "-c", "echo hello from the job; exit 3"))
    finished = _wait(backend, record.id, lambda r: r.state is JobState.FAILED)
    assert finished.exit_code == 3 and finished.reason == "exited with status 3"
    assert "hello from the job" in Path(finished.log_path).read_text()
    ok = backend.submit(_request("true"))
    assert _wait(backend, ok.id, lambda r: r.state is JobState.DONE).exit_code == 0


def test_a_job_waits_while_the_machine_is_full_and_starts_when_room_frees(backend: LocalBackend) -> None:
    hog = backend.submit(_request("sleep", "30", cpus=2))
    assert hog.state is JobState.RUNNING and hog.pid is not None
    waiting = backend.submit(_request("true", cpus=0.5))
    assert waiting.state is JobState.QUEUED
    cancelled = backend.cancel(hog.id)
    assert cancelled.state is JobState.CANCELLED
    assert not alive(hog.pid)
    assert _wait(backend, waiting.id, lambda r: r.state is JobState.DONE).attempts == 1


def test_memory_is_accounted_like_cpus(backend: LocalBackend) -> None:
    big = backend.submit(_request("sleep", "30", cpus=0.1, memory_mib=1000))
    small = backend.submit(_request("true", cpus=0.1, memory_mib=100))
    assert (big.state, small.state) == (JobState.RUNNING, JobState.QUEUED)
    backend.cancel(big.id)
    _wait(backend, small.id, lambda r: r.state is JobState.DONE)


def test_a_finished_job_starts_the_next_one_without_anyone_asking(backend: LocalBackend) -> None:
    first = backend.submit(_request("sleep", "0.3", cpus=2))
    second = backend.submit(_request("true", cpus=2))
    assert second.state is JobState.QUEUED
    # The first job's supervisor records its exit and runs the next scheduling pass itself.
    _wait(backend, second.id, lambda r: r.state is JobState.DONE)
    assert backend.get(first.id).state is JobState.DONE


def test_cancel_kills_the_whole_process_group(backend: LocalBackend, tmp_path: Path) -> None:
    marker = tmp_path / "grandchild.pid"
    record = backend.submit(_request("sh", "-c", f"sleep 30 & echo $! > {marker}; wait"))
    _wait(backend, record.id, lambda r: marker.exists() and marker.read_text().strip() != "")
    grandchild = int(marker.read_text())
    backend.cancel(record.id)
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild)


def test_cancel_kills_a_job_that_ignores_sigterm(backend: LocalBackend, tmp_path: Path) -> None:
    marker = tmp_path / "stubborn.pid"
    record = backend.submit(_request("sh", "-c", f"trap '' TERM; sleep 30 & echo $! > {marker}; wait"))
    _wait(backend, record.id, lambda r: marker.exists() and marker.read_text().strip() != "")
    stubborn = int(marker.read_text())
    backend.cancel(record.id)
    assert not alive(stubborn)


def test_a_higher_priority_job_preempts_and_the_victim_requeues(tmp_path: Path) -> None:
    backend = LocalBackend.open(tmp_path / "jobs.sqlite", capacity=CAPACITY, policy="priority")
    victim = backend.submit(_request("sleep", "30", cpus=2, preemptible=True))
    urgent = backend.submit(_request("sleep", "30", cpus=2, priority=5))
    # The victim stops (SIGTERM) and requeues; its supervisor's pass then starts the urgent job.
    _wait(backend, urgent.id, lambda r: r.state is JobState.RUNNING)
    requeued = backend.get(victim.id)
    assert requeued.state is JobState.QUEUED and "preempted by" in requeued.reason
    assert requeued.preemptions == 1
    assert victim.pid is not None and wait_group(victim.pid, 5)
    backend.cancel(urgent.id)
    restarted = _wait(backend, victim.id, lambda r: r.state is JobState.RUNNING)
    assert restarted.attempts == 2
    backend.cancel(victim.id)


def test_a_job_whose_supervisor_vanished_is_marked_failed(backend: LocalBackend) -> None:
    record = backend.submit(_request("sleep", "30"))
    assert record.pid is not None
    os.killpg(record.pid, 9)
    _wait(backend, record.id, lambda r: not alive(record.pid or 0), timeout_s=5)
    backend.schedule()
    assert backend.get(record.id).reason == "its supervisor vanished"


def test_the_store_remembers_capacity_and_policy(tmp_path: Path) -> None:
    LocalBackend.open(tmp_path / "jobs.sqlite", capacity=CAPACITY, policy="priority")
    reopened = LocalBackend.open(tmp_path / "jobs.sqlite")
    assert (reopened.capacity, reopened.policy.name) == (CAPACITY, "priority")


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (_request("true", cpus=3), "asks for 3 CPUs but this machine has 2"),
        (_request("true", memory_mib=4096), "asks for 4096 MiB of memory but this machine has 1024"),
        (_request("true", accelerators=1), "asks for 1 accelerators but this machine has 0"),
        (_request("true", cpus=0), "at least one accelerator or some CPU"),
        (_request("no-such-program-xyz"), "'no-such-program-xyz' is not an executable file"),
        (_request(), "no command given"),
        (_request("true", expected_duration_s=0), "expected duration 0 s must be positive"),
    ],
)
def test_impossible_jobs_are_refused_with_a_reason(
    backend: LocalBackend, request_: JobRequest, expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        backend.submit(request_)
    assert backend.store.all() == []


def test_cancelling_unknown_or_finished_jobs_is_an_error(backend: LocalBackend) -> None:
    with pytest.raises(ConfigError, match="no job with id 42"):
        backend.cancel(42)
    record = backend.submit(_request("true"))
    _wait(backend, record.id, lambda r: r.state is JobState.DONE)
    with pytest.raises(ConfigError, match="already done"):
        backend.cancel(record.id)


def test_a_preempted_job_that_ignores_sigterm_is_killed_after_its_grace(tmp_path: Path) -> None:
    backend = LocalBackend.open(tmp_path / "jobs.sqlite", capacity=CAPACITY, policy="priority")
    marker = tmp_path / "stubborn.pid"
    script = f"trap '' TERM; sleep 30 & echo $! > {marker}; wait"
    victim = backend.submit(_request("sh", "-c", script, cpus=2, preemptible=True, stop_grace_s=1.0))
    _wait(backend, victim.id, lambda r: marker.exists() and marker.read_text().strip() != "")
    started = time.monotonic()
    urgent = backend.submit(_request("sleep", "30", cpus=2, priority=5))
    assert backend.get(victim.id).state is JobState.PREEMPTING  # still holding the machine
    _wait(backend, urgent.id, lambda r: r.state is JobState.RUNNING)
    assert time.monotonic() - started >= 1.0  # it was given its grace before SIGKILL
    assert not alive(int(marker.read_text()))
    assert backend.get(victim.id).state is JobState.QUEUED
    backend.cancel(urgent.id)
    backend.cancel(victim.id)
