"""The process that owns one local job: runs its replicas, stops them when asked, records how it ended.

Started by the local back end as a session leader (`python -m tether.scheduler.supervisor DB JOB_ID`).
The job's replicas run in one process group of their own, each with `CUDA_VISIBLE_DEVICES` set to its
share of the job's devices (empty for a job without accelerators, so it never touches GPU 0). SIGTERM
to the supervisor means "stop the job": it forwards SIGTERM to the replicas and SIGKILLs them after the
grace period (the job's `stop_grace_s` for a preemption, so a train job can finish its step and
checkpoint; `KILL_GRACE_S` for a cancel). Then it records the outcome (done, failed, requeued after a
preemption, or restarted: a service that failed), and runs the next scheduling pass.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

from tether.scheduler.devices import visible_devices
from tether.scheduler.job import JobState
from tether.scheduler.local import KILL_GRACE_S, LocalBackend, replica_commands
from tether.scheduler.monitor import StragglerWatch
from tether.scheduler.processes import signal_group
from tether.scheduler.state import Preempt
from tether.scheduler.store import JobRecord
from tether.scheduler.workload import WORKLOADS, Restart

POLL_S = 0.1
WATCH_EVERY_S = 1.0


def replica_metrics_file(record: JobRecord, replica: int) -> Path:
    """Where replica `replica` of a gang writes its step times (`TETHER_METRICS_FILE`)."""
    return Path(record.log_path).with_suffix("") / f"replica-{replica}" / "metrics.jsonl"


@dataclass(frozen=True, slots=True)
class Outcome:
    exit_code: int
    reason: str


class Supervisor:
    def __init__(self, backend: LocalBackend, job_id: int) -> None:
        self.backend = backend
        self.job_id = job_id
        self.stop_requested = False

    def request_stop(self, signum: int = 0, frame: FrameType | None = None) -> None:
        self.stop_requested = True

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # blocked by the back end at launch
        # The pass that started us commits the record after we start: a write transaction waits for it.
        with self.backend.store.transaction():
            record = self.backend.get(self.job_id)
        while self._ours(record):
            if not self._record(self._attempt(record)):
                break
            record = self.backend.get(self.job_id)
        self.backend.schedule()

    def _ours(self, record: JobRecord) -> bool:
        return record.state in (JobState.RUNNING, JobState.PREEMPTING) and record.pid == os.getpid()

    def _record(self, outcome: Outcome) -> bool:
        """Write how the attempt ended; True when the job runs again at once (a restarted service)."""
        store = self.backend.store
        with store.transaction():
            current = self.backend.get(self.job_id)
            # A cancel has already rewritten the record; only a job still ours is finished here.
            if not self._ours(current):
                return False
            if current.state is JobState.PREEMPTING:
                store.mark_queued(self.job_id, current.reason)
                with open(current.log_path, "ab") as log:  # the record's reason goes when it restarts
                    log.write(f"tether: job {self.job_id} requeued: {current.reason}\n".encode())
                return False
            workload = WORKLOADS[current.request.workload]
            if (
                outcome.exit_code != 0
                and workload.restart is Restart.ON_FAILURE
                and current.restarts < current.request.max_restarts
                and not self.stop_requested
            ):
                store.note_restart(self.job_id, f"restarted after it {outcome.reason}")
                return True
            state = JobState.DONE if outcome.exit_code == 0 else JobState.FAILED
            store.mark_finished(self.job_id, state, self.backend.clock(), outcome.exit_code, outcome.reason)
            return False

    def _attempt(self, record: JobRecord) -> Outcome:
        commands = replica_commands(record)
        share = record.request.accelerators
        with open(record.log_path, "ab") as log:
            processes: list[subprocess.Popen[bytes]] = []
            try:
                for replica, command in enumerate(commands):
                    devices = record.devices[replica * share : (replica + 1) * share]
                    processes.append(self._spawn(record, replica, command, devices, log, processes))
            except OSError as error:
                reason = f"could not start: {error}"
                log.write(f"tether: {reason}\n".encode())
                if processes:
                    signal_group(processes[0].pid, signal.SIGKILL)
                    for process in processes:
                        process.wait()
                return Outcome(127, reason)
            pgid = processes[0].pid
            with self.backend.store.transaction():
                self.backend.store.set_child(self.job_id, pgid)
            return self._wait(record, processes, pgid)

    def _spawn(
        self,
        record: JobRecord,
        replica: int,
        command: tuple[str, ...],
        devices: tuple[int, ...],
        log: IO[bytes],
        group: list[subprocess.Popen[bytes]],
    ) -> subprocess.Popen[bytes]:
        metrics = replica_metrics_file(record, replica)
        metrics.parent.mkdir(parents=True, exist_ok=True)
        metrics.unlink(missing_ok=True)  # step times of an earlier attempt say nothing about this one
        env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": visible_devices(devices),
            "TETHER_JOB_ID": str(record.id),
            "TETHER_JOB_REPLICA": str(replica),
            "TETHER_METRICS_FILE": str(metrics),
        }
        port = f" port {record.ports[replica]}" if record.ports else ""
        log.write(
            f"tether: job {record.id} attempt {record.attempts} replica {replica}{port}: "
            f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r} {' '.join(command)}\n".encode()
        )
        log.flush()
        return subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            process_group=group[0].pid if group else 0,
        )

    def _wait(self, record: JobRecord, processes: list[subprocess.Popen[bytes]], pgid: int) -> Outcome:
        """Poll the replicas until all exit; a failed replica stops the gang, a stop request all of it."""
        watch = (
            StragglerWatch(
                [replica_metrics_file(record, r) for r in range(len(processes))], self.backend.stragglers
            )
            if len(processes) > 1
            else None
        )
        kill_at: float | None = None
        next_watch = time.monotonic() + WATCH_EVERY_S
        failed: Outcome | None = None
        while any(code is None for code in [p.poll() for p in processes]):
            now = time.monotonic()
            if failed is None:
                failed = next(
                    (
                        Outcome(code, f"exited with status {code}")
                        for p in processes
                        if (code := p.returncode)
                    ),
                    None,
                )
                if failed is not None:
                    self.stop_requested = True  # the gang stops with its failed replica
            if self.stop_requested and kill_at is None:
                signal_group(pgid, signal.SIGTERM)
                kill_at = now + self._grace()
            if kill_at is not None and now >= kill_at:
                signal_group(pgid, signal.SIGKILL)
            if watch is not None and kill_at is None and now >= next_watch:
                next_watch = now + WATCH_EVERY_S
                self._act_on_stragglers(watch)
            time.sleep(POLL_S)
        # The replicas are gone; whatever they left running in their group goes with them.
        signal_group(pgid, signal.SIGKILL)
        if failed is not None:
            return failed
        code = next((p.returncode for p in processes if p.returncode), 0)
        return Outcome(code, "" if code == 0 else f"exited with status {code}")

    def _grace(self) -> float:
        record = self.backend.get(self.job_id)
        return record.request.stop_grace_s if record.state is JobState.PREEMPTING else KILL_GRACE_S

    def _act_on_stragglers(self, watch: StragglerWatch) -> None:
        flagged = watch.poll()
        if flagged is None:
            return
        decision = self.backend.straggler_decision(self.job_id, len(flagged.replicas), flagged.slowdown)
        if isinstance(decision, Preempt):
            replicas = ", ".join(str(r) for r in flagged.replicas)
            with self.backend.store.transaction():
                self.backend.store.mark_preempting(
                    self.job_id, f"{decision.reason} (slow replicas {replicas}, {flagged.slowdown:.1f}x)"
                )
            self.stop_requested = True


def supervise(db_path: Path, job_id: int) -> int:
    backend = LocalBackend.open(db_path)
    with contextlib.suppress(KeyboardInterrupt):
        Supervisor(backend, job_id).run()
    return 0


if __name__ == "__main__":
    sys.exit(supervise(Path(sys.argv[1]), int(sys.argv[2])))
