"""Runs a `ClusterPlan`: starts each piece once what it waits for is healthy, restarts a piece that exits
(after a doubling backoff, at most `restart_limit` times), and stops everything in reverse start order,
SIGTERM first and SIGKILL after `stop_timeout_s`. Every change is written to the state file.

A piece alive but failing its health check is not restarted (a slow engine step is no crash): `tether
up status` shows it unhealthy. Each piece runs in its own session (its own process group), so a stop or
a crash cleanup reaches the processes it started too. The supervisor prints nothing: `tether up` shows
what the state file says.
Also runnable as `python -m tether.local_cluster.supervisor CLUSTER_TOML HOME` (`tether up --detach`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tether.errors import ConfigError, TetherError
from tether.local_cluster.config import load_cluster_file
from tether.local_cluster.plan import ClusterPlan, PieceSpec, plan_cluster
from tether.local_cluster.services import check_services
from tether.local_cluster.state import (
    ClusterState,
    Phase,
    PieceState,
    PieceStatus,
    ProcessRef,
    clusters_dir,
    remove_state,
    start_ticks,
    this_process,
    write_state,
)

POLL_S = 0.3
LOG_TAIL_LINES = 15


class StartFailed(TetherError):
    """A piece did not become healthy; the message says which, why, and the end of its log."""


def prepare(config_path: Path, home: Path) -> ClusterPlan:
    """The plan of the cluster `config_path` describes (its state under `home`); ConfigError if it is bad."""
    cluster = load_cluster_file(config_path)
    model = cluster.engine.model if cluster.engine is not None else ""
    is_folder = bool(model) and (Path(model) / "config.json").is_file()
    return plan_cluster(cluster, clusters_dir(home) / cluster.name, sys.executable, is_folder)


def healthy(url: str, timeout_s: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def port_taken(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def kill_group(pid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


class Supervisor:
    def __init__(self, plan: ClusterPlan, home: Path, config_path: Path) -> None:
        self.plan, self.home = plan, home
        self.stopping = threading.Event()
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.order: list[str] = []  # start order; stopped in reverse
        self.restart_at: dict[str, float] = {}
        self.state = ClusterState(
            name=plan.name,
            supervisor=this_process(),
            config=str(config_path.absolute()),
            state_dir=str(plan.state_dir),
            started_at=time.time(),
            pieces=[
                PieceState(
                    name=p.name,
                    kind=p.kind.value,
                    url=p.url,
                    port=p.port,
                    health_url=p.health_url,
                    log=str(self._log(p.name)),
                )
                for p in plan.pieces
            ],
        )

    # ---- the three phases -------------------------------------------------------------------------

    def start(self) -> None:
        """Start every piece in dependency order and wait until each is healthy; StartFailed otherwise
        (the pieces already started keep running: call `stop`)."""
        (self.plan.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        for name, content in self.plan.files.items():
            (self.plan.state_dir / name).write_text(content)
        for piece in self.plan.pieces:
            if port_taken(self.plan.host, piece.port):
                raise StartFailed(f"port {piece.port} of {piece.name} is in use by another program")
        self._save()
        pending = list(self.plan.pieces)
        started: dict[str, float] = {}
        while pending or any(self._piece(n).status is PieceStatus.STARTING for n in started):
            if self.stopping.is_set():
                raise StartFailed("interrupted while starting")
            for piece in [
                p for p in pending if all(self._piece(d).status is PieceStatus.RUNNING for d in p.after)
            ]:
                pending.remove(piece)
                self._spawn(piece)
                started[piece.name] = time.monotonic()
            for name, since in started.items():
                state = self._piece(name)
                if state.status is not PieceStatus.STARTING:
                    continue
                code = self.processes[name].poll()
                if code is not None:
                    raise StartFailed(self._why(name, f"exited with status {code} before it was healthy"))
                if healthy(state.health_url):
                    self._set(name, PieceStatus.RUNNING)
                elif time.monotonic() - since > self.plan.supervisor.ready_timeout_s:
                    timeout = self.plan.supervisor.ready_timeout_s
                    raise StartFailed(
                        self._why(name, f"was not healthy within {timeout:g} s ({state.health_url})")
                    )
            self.stopping.wait(POLL_S)
        self.state.phase = Phase.UP
        self._save()

    def watch(self) -> None:
        """Until `stopping` is set: restart pieces that exit, within the restart limit."""
        while not self.stopping.wait(POLL_S):
            for name in list(self.order):
                self._check(self.plan.piece(name))

    def stop(self) -> None:
        """Stop every started piece, last started first; SIGKILL what ignores SIGTERM for too long."""
        self.state.phase = Phase.STOPPING if self.state.phase is not Phase.FAILED else Phase.FAILED
        self._save()
        for name in reversed(self.order):
            process = self.processes[name]
            if process.poll() is None:  # one waiting for its restart was cleaned up when it exited
                kill_group(process.pid, signal.SIGTERM)
                try:
                    process.wait(self.plan.supervisor.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    kill_group(process.pid, signal.SIGKILL)
                    process.wait()
                kill_group(process.pid, signal.SIGKILL)  # what the piece started and left behind
            self._set(name, PieceStatus.STOPPED)

    def run(self, on_up: Callable[[ClusterState], None] = lambda _: None) -> None:
        """start, `on_up`, watch until SIGINT/SIGTERM, stop, remove the state file. A failed start is
        recorded in the state file (phase failed, with the error), which stays for the caller, and raised."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: self.stopping.set())
        try:
            self.start()
        except StartFailed as error:
            self.state.phase, self.state.error = Phase.FAILED, str(error)
            self.stop()
            raise
        except BaseException:
            self.stop()
            raise
        try:
            on_up(self.state)
            self.watch()
        finally:
            self.stop()
        remove_state(self.home, self.plan.name)

    # ---- pieces ------------------------------------------------------------------------------------

    def _check(self, piece: PieceSpec) -> None:
        state = self._piece(piece.name)
        supervisor = self.plan.supervisor
        if state.status is PieceStatus.RESTARTING:
            if time.monotonic() >= self.restart_at[piece.name]:
                state.restarts += 1
                self._spawn(piece)
            return
        if state.status not in (PieceStatus.RUNNING, PieceStatus.STARTING):
            return
        process = self.processes[piece.name]
        crashed = process.poll() is not None
        if state.status is PieceStatus.STARTING and not crashed:
            assert state.started_at is not None
            if healthy(piece.health_url):
                self._set(piece.name, PieceStatus.RUNNING)
            elif time.time() - state.started_at > supervisor.ready_timeout_s:
                kill_group(process.pid, signal.SIGKILL)
                process.wait()
                crashed = True
        if not crashed:
            return
        kill_group(process.pid, signal.SIGKILL)  # the crashed piece's own children
        if state.restarts >= supervisor.restart_limit:
            self._set(piece.name, PieceStatus.FAILED)
            return
        backoff = min(supervisor.backoff_s * 2**state.restarts, supervisor.backoff_max_s)
        self.restart_at[piece.name] = time.monotonic() + backoff
        self._set(piece.name, PieceStatus.RESTARTING)

    def _spawn(self, piece: PieceSpec) -> None:
        with open(self._log(piece.name), "ab") as log:
            process = subprocess.Popen(
                piece.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **piece.env},
                start_new_session=True,
            )
        self.processes[piece.name] = process
        if piece.name not in self.order:
            self.order.append(piece.name)
        state = self._piece(piece.name)
        ticks = start_ticks(process.pid)
        state.process = None if ticks is None else ProcessRef(pid=process.pid, start_ticks=ticks)
        state.started_at = time.time()
        self._set(piece.name, PieceStatus.STARTING)

    def _why(self, name: str, what: str) -> str:
        tail = log_tail(self._log(name))
        return f"{name} {what}; the end of {self._log(name)}:\n{tail}" if tail else f"{name} {what}"

    def _log(self, name: str) -> Path:
        return self.plan.state_dir / "logs" / f"{name}.log"

    def _piece(self, name: str) -> PieceState:
        return next(p for p in self.state.pieces if p.name == name)

    def _set(self, name: str, status: PieceStatus) -> None:
        self._piece(name).status = status
        self._save()

    def _save(self) -> None:
        write_state(self.home, self.state)


def main(config_path: Path, home: Path) -> int:
    """The detached supervisor: the run `tether up` makes in the foreground, its outcome in the state file."""
    try:
        plan = prepare(config_path, home)
        check_services(plan.services)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        Supervisor(plan, home, config_path).run()
    except StartFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
