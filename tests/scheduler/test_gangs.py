"""Gangs on the local back end: each replica's own devices, and a straggling replica acted on from the
step times in its metrics file (fake job processes write them)."""

from __future__ import annotations

from pathlib import Path

from tether.scheduler.job import JobState
from tether.scheduler.local import LocalBackend, MachineCapacity
from tether.scheduler.straggler import StragglerConfig
from tether.scheduler.supervisor import replica_metrics_file

from .test_local import _request, _wait

TWO_GPUS = MachineCapacity(cpus=4, memory_mib=2048, accelerators=2)


def test_each_replica_sees_only_its_own_devices_and_a_cpu_job_none(tmp_path: Path) -> None:
    backend = LocalBackend.open(tmp_path / "jobs.sqlite", capacity=TWO_GPUS)
    seen = tmp_path / "seen"
    echo = f'echo "$TETHER_JOB_REPLICA=[$CUDA_VISIBLE_DEVICES]" >> {seen}'
    gang = backend.submit(_request("sh", "-c", echo, accelerators=1, replicas=2))
    assert gang.devices == (0, 1)
    _wait(backend, gang.id, lambda r: r.state is JobState.DONE)
    assert sorted(seen.read_text().split()) == ["0=[0]", "1=[1]"]
    seen.unlink()
    cpu = backend.submit(_request("sh", "-c", echo))
    _wait(backend, cpu.id, lambda r: r.state is JobState.DONE)
    assert seen.read_text().split() == ["0=[]"]  # set and empty: the job cannot grab GPU 0


def test_a_gang_with_a_straggling_replica_is_requeued(tmp_path: Path) -> None:
    config = StragglerConfig(threshold=1.5, window_steps=5, restart_s=1.0)
    backend = LocalBackend.open(tmp_path / "jobs.sqlite", capacity=TWO_GPUS, stragglers=config)
    # Replica 2 reports steps three times as slow as its peers; then all keep running.
    script = (
        'step=0.1; [ "$TETHER_JOB_REPLICA" = 2 ] && step=0.3; '
        "for i in 1 2 3 4 5 6; do "
        'echo "{\\"step\\": $i, \\"time/step_s\\": $step}" >> "$TETHER_METRICS_FILE"; done; '
        "sleep 30"
    )
    gang = backend.submit(_request("sh", "-c", script, cpus=1, replicas=3, preemptible=True))
    requeued = _wait(backend, gang.id, lambda r: r.preemptions == 1, timeout_s=20)
    log = Path(requeued.log_path).read_text()
    assert "requeued: straggler on node 0: rescheduled (slow replicas 2, 3.0x)" in log
    assert replica_metrics_file(requeued, 2).is_file()
    restarted = _wait(backend, gang.id, lambda r: r.state is JobState.RUNNING and r.attempts == 2)
    backend.cancel(restarted.id)


def test_a_gang_without_stragglers_keeps_running(tmp_path: Path) -> None:
    config = StragglerConfig(threshold=1.5, window_steps=5, restart_s=1.0)
    backend = LocalBackend.open(tmp_path / "jobs.sqlite", capacity=TWO_GPUS, stragglers=config)
    script = (
        "for i in 1 2 3 4 5 6; do "
        'echo "{\\"step\\": $i, \\"time/step_s\\": 0.1}" >> "$TETHER_METRICS_FILE"; done; '
        "sleep 2.5"
    )
    gang = backend.submit(_request("sh", "-c", script, cpus=1, replicas=3, preemptible=True))
    done = _wait(backend, gang.id, lambda r: r.state is JobState.DONE)
    assert (done.preemptions, done.attempts) == (0, 1)
