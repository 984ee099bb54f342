"""What `tether up --detach`, `tether up status` and `tether down` do to a cluster whose supervisor is
another process: start that process in its own session, read its state file, check each piece's health
live, and stop it (SIGTERM to the supervisor; whatever outlives it is killed by its recorded pid).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tether.local_cluster.plan import ClusterPlan
from tether.local_cluster.state import ClusterState, Phase, PieceStatus, read_state, remove_state, uptime_s
from tether.local_cluster.supervisor import healthy, kill_group, log_tail

SUPERVISOR_LOG = "supervisor.log"


@dataclass(frozen=True, slots=True)
class PieceRow:
    """One line of `tether up status`."""

    name: str
    kind: str
    pid: int | None
    url: str
    status: PieceStatus
    healthy: bool
    restarts: int
    uptime_s: float | None

    def as_dict(self) -> dict[str, object]:
        return {
            "piece": self.name,
            "kind": self.kind,
            "pid": self.pid,
            "url": self.url,
            "status": self.status.value,
            "healthy": self.healthy,
            "restarts": self.restarts,
            "uptime_s": None if self.uptime_s is None else round(self.uptime_s, 1),
        }


def live_rows(state: ClusterState) -> list[PieceRow]:
    """Every piece as the state file records it, with a health check made now (in parallel)."""
    alive = [p.process is not None and p.process.alive() for p in state.pieces]
    with ThreadPoolExecutor(max_workers=max(1, len(state.pieces))) as pool:
        checks = list(pool.map(lambda p: healthy(p.health_url, timeout_s=2.0), state.pieces))
    now = time.time()
    return [
        PieceRow(
            piece.name,
            piece.kind,
            piece.process.pid if piece.process is not None and up else None,
            piece.url,
            piece.status,
            up and check,
            piece.restarts,
            uptime_s(piece, now),
        )
        for piece, up, check in zip(state.pieces, alive, checks, strict=True)
    ]


def launch_detached(plan: ClusterPlan, config_path: Path, home: Path) -> subprocess.Popen[bytes]:
    """The supervisor as a session leader of its own, its output in the cluster's supervisor.log, so that
    it outlives this command and the terminal it ran in."""
    plan.state_dir.mkdir(parents=True, exist_ok=True)
    with open(plan.state_dir / SUPERVISOR_LOG, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tether.local_cluster.supervisor", str(config_path.absolute()), str(home)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def wait_until_up(plan: ClusterPlan, home: Path, process: subprocess.Popen[bytes]) -> ClusterState:
    """The state once the detached supervisor reports the cluster up; RuntimeError with its reason (the
    supervisor's error or the end of its log) when it fails or exits first."""
    while True:
        state = read_state(home, plan.name)
        if state is not None and state.phase is Phase.UP:
            return state
        if state is not None and state.phase is Phase.FAILED:
            process.wait()
            raise RuntimeError(state.error)
        if process.poll() is not None:
            tail = log_tail(plan.state_dir / SUPERVISOR_LOG)
            raise RuntimeError(f"the supervisor exited with status {process.returncode}:\n{tail}")
        time.sleep(0.3)


def stop_cluster(
    home: Path, name: str, supervisor_timeout_s: float = 120.0, piece_timeout_s: float = 10.0
) -> ClusterState:
    """Stop cluster `name` and remove its state; the state it had. The supervisor stops its pieces in
    order; a piece still alive after it (a supervisor killed with -9, or hung) is stopped here."""
    state = read_state(home, name)
    assert state is not None, name
    if state.supervisor.alive():
        os.kill(state.supervisor.pid, signal.SIGTERM)
        deadline = time.monotonic() + supervisor_timeout_s
        while state.supervisor.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        if state.supervisor.alive():  # hung: it must not restart what is stopped below
            os.kill(state.supervisor.pid, signal.SIGKILL)
    leftovers = [p.process for p in state.pieces if p.process is not None and p.process.alive()]
    for process in leftovers:
        kill_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + piece_timeout_s
    while any(p.alive() for p in leftovers) and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in leftovers:
        kill_group(process.pid, signal.SIGKILL)
    remove_state(home, name)
    return state
