"""The supervisor on a stand-in piece (a stdlib HTTP server): restarts after a crash, counted, until the
restart limit, after which the piece is left down as failed; a stop leaves no process."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from tests.live_server import free_port
from tether.local_cluster.config import SupervisorSection
from tether.local_cluster.plan import ClusterPlan, PieceKind, PieceSpec
from tether.local_cluster.state import PieceState, PieceStatus, read_state, start_ticks
from tether.local_cluster.supervisor import Supervisor


def test_a_crashed_piece_is_restarted_until_the_limit_then_left_failed(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = (sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1")
    piece = PieceSpec("web", PieceKind.GATEWAY, argv, {}, port, url, f"{url}/")
    limits = SupervisorSection(restart_limit=1, backoff_s=0.1, ready_timeout_s=30, stop_timeout_s=5)
    plan = ClusterPlan("s", "127.0.0.1", tmp_path / "clusters" / "s", (piece,), (), {}, limits)
    supervisor = Supervisor(plan, tmp_path, tmp_path / "cluster.toml")
    supervisor.start()
    watcher = threading.Thread(target=supervisor.watch)
    watcher.start()

    def web() -> PieceState:
        state = read_state(tmp_path, "s")
        assert state is not None
        return state.pieces[0]

    def wait(status: PieceStatus, restarts: int) -> PieceState:
        deadline = time.monotonic() + 30
        while (now := web()).status is not status or now.restarts != restarts:
            assert time.monotonic() < deadline, now
            time.sleep(0.1)
        return now

    try:
        first = wait(PieceStatus.RUNNING, 0)
        assert first.process is not None
        os.kill(first.process.pid, signal.SIGKILL)
        second = wait(PieceStatus.RUNNING, 1)
        assert second.process is not None and second.process.pid != first.process.pid
        os.kill(second.process.pid, signal.SIGKILL)
        wait(PieceStatus.FAILED, 1)  # the limit is spent: not started a third time
    finally:
        supervisor.stopping.set()
        watcher.join()
        supervisor.stop()
    assert web().status is PieceStatus.STOPPED
    assert start_ticks(second.process.pid) is None
    assert (plan.state_dir / "logs" / "web.log").exists()
