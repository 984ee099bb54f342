"""The state of a running local cluster on disk, so that `tether up status` and `tether down` in another
shell find it: $TETHER_HOME/clusters/NAME.json (written atomically by the supervisor on every change) and
the folder NAME/ beside it (logs, the generated gateway config, the agents' embedded state).

A pid alone could name a stranger once the process is gone, so every pid is kept with its start time
(from /proc); a pid whose start time differs is treated as gone and never signalled.
"""

from __future__ import annotations

import contextlib
import os
import time
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from tether.errors import ConfigError


class Phase(StrEnum):
    STARTING = "starting"
    UP = "up"
    FAILED = "failed"  # a piece did not start: the supervisor stops the rest and exits
    STOPPING = "stopping"


class PieceStatus(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"  # exited; restarted after its backoff
    FAILED = "failed"  # exited more often than restart_limit allows: left down
    STOPPED = "stopped"


class ProcessRef(BaseModel):
    model_config = ConfigDict(frozen=True)

    pid: int
    start_ticks: int  # field 22 of /proc/PID/stat: with the pid, names one process for ever

    def alive(self) -> bool:
        return start_ticks(self.pid) == self.start_ticks


class PieceState(BaseModel):
    name: str
    kind: str
    url: str
    port: int
    health_url: str
    status: PieceStatus = PieceStatus.STARTING
    process: ProcessRef | None = None
    started_at: float | None = None
    restarts: int = 0
    log: str = ""


class ClusterState(BaseModel):
    name: str
    phase: Phase = Phase.STARTING
    supervisor: ProcessRef
    config: str  # the cluster.toml it was started from
    state_dir: str
    started_at: float
    error: str = ""
    pieces: list[PieceState] = []


def clusters_dir(home: Path) -> Path:
    return home / "clusters"


def state_path(home: Path, name: str) -> Path:
    return clusters_dir(home) / f"{name}.json"


def start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count fields after its last ')'
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has exited; only its parent's wait is missing
        return None
    return int(fields[19])


def this_process() -> ProcessRef:
    ticks = start_ticks(os.getpid())
    assert ticks is not None
    return ProcessRef(pid=os.getpid(), start_ticks=ticks)


def write_state(home: Path, state: ClusterState) -> None:
    path = state_path(home, state.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(state.model_dump_json(indent=2))
    temporary.replace(path)


def read_state(home: Path, name: str) -> ClusterState | None:
    path = state_path(home, name)
    try:
        return ClusterState.model_validate_json(path.read_text())
    except FileNotFoundError:
        return None
    except ValidationError as error:
        raise ConfigError(
            f"{path}: not a cluster state file ({error.error_count()} problems); remove it"
        ) from None


def remove_state(home: Path, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        state_path(home, name).unlink()


def cluster_names(home: Path) -> list[str]:
    return sorted(path.stem for path in clusters_dir(home).glob("*.json"))


def pick_cluster(home: Path, name: str | None) -> str:
    """`name`, or the one cluster that is up; a clear error when none is, or several and no name."""
    names = cluster_names(home)
    if name is not None:
        if name not in names:
            up = f"; up: {', '.join(names)}" if names else ""
            raise ConfigError(f"no cluster named {name!r} is up (no {state_path(home, name)}){up}")
        return name
    if not names:
        raise ConfigError(
            f"nothing is up: no cluster state in {clusters_dir(home)} (start one with `tether up`)"
        )
    if len(names) > 1:
        raise ConfigError(f"several clusters are up ({', '.join(names)}): choose one with --name")
    return names[0]


def uptime_s(piece: PieceState, now: float | None = None) -> float | None:
    if piece.started_at is None or piece.status is not PieceStatus.RUNNING:
        return None
    return (time.time() if now is None else now) - piece.started_at
