"""Workload kinds: how the local back end launches, stops and restarts each kind of job.

A job's command is recognized as one of tether's own workloads (`tether train`, `tether eval`,
`tether serve`, a fleet of `tether sandbox serve`) by its subcommand, through the `WORKLOADS` registry;
anything else is a plain command. A kind says which `JobKind` it is, whether a failure restarts it (a
service), whether it checkpoints (a preempted train job resumes with `--resume RUN_DIR`), and how each
replica's argv is built. It starts nothing; `has_checkpoint` is its one read of the disk.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from tether.errors import ConfigError
from tether.scheduler.job import JobKind

# `tether ...` or `python -m tether ...`: both run in this interpreter, whatever PATH holds.
TETHER = (sys.executable, "-m", "tether")


class WorkloadKind(Enum):
    COMMAND = "command"
    TRAIN = "train"
    EVAL = "eval"
    SERVE = "serve"
    SANDBOX_FLEET = "sandbox-fleet"


class Restart(Enum):
    NEVER = "never"
    ON_FAILURE = "on-failure"


@dataclass(frozen=True, slots=True)
class Workload:
    kind: WorkloadKind
    job_kind: JobKind
    subcommand: tuple[str, ...]  # what follows `tether` in the command; () for a plain command
    restart: Restart = Restart.NEVER
    resumable: bool = False  # checkpoints on SIGTERM and continues with `--resume RUN_DIR`
    port_per_replica: bool = False  # each replica gets its own `--port`
    gang: bool = False  # may run several replicas, all started and stopped together

    def replica_commands(
        self, command: Sequence[str], replicas: int, ports: Sequence[int], run_dir: str, resume: bool
    ) -> list[tuple[str, ...]]:
        """The argv of every replica; a tether workload runs in this interpreter."""
        assert len(ports) == (replicas if self.port_per_replica else 0), "one port per replica"
        args = tuple(command[tether_args_start(command) :]) if self.subcommand else tuple(command)
        if self.resumable and resume:
            args = (*self.subcommand, "--resume", run_dir)
        base = (*TETHER, *args) if self.subcommand else args
        if self.port_per_replica:
            return [(*base, "--port", str(port)) for port in ports]
        return [base] * replicas


WORKLOADS: dict[WorkloadKind, Workload] = {
    w.kind: w
    for w in (
        Workload(WorkloadKind.COMMAND, JobKind.AGENT, (), gang=True),
        Workload(WorkloadKind.TRAIN, JobKind.RL, ("train",), resumable=True),
        Workload(WorkloadKind.EVAL, JobKind.EVAL, ("eval",)),
        Workload(WorkloadKind.SERVE, JobKind.SERVE, ("serve",), restart=Restart.ON_FAILURE),
        Workload(
            WorkloadKind.SANDBOX_FLEET,
            JobKind.SANDBOX,
            ("sandbox", "serve"),
            restart=Restart.ON_FAILURE,
            port_per_replica=True,
            gang=True,
        ),
    )
}

_BY_SUBCOMMAND = {w.subcommand: w.kind for w in WORKLOADS.values() if w.subcommand}


def has_checkpoint(run_dir: str) -> bool:
    """Whether a train run directory holds a checkpoint to resume from (`checkpoints/latest`)."""
    return bool(run_dir) and (Path(run_dir) / "checkpoints" / "latest").is_file()


def tether_args_start(command: Sequence[str]) -> int:
    """Where the arguments to tether begin in `tether ...` or `python -m tether ...`; 0 if neither."""
    if command and Path(command[0]).name == "tether":
        return 1
    if (
        len(command) >= 3
        and Path(command[0]).name.startswith("python")
        and tuple(command[1:3])
        == (
            "-m",
            "tether",
        )
    ):
        return 3
    return 0


def recognize(command: Sequence[str]) -> WorkloadKind:
    """The workload a command is: a tether subcommand in `WORKLOADS`, else a plain command."""
    start = tether_args_start(command)
    if not start:
        return WorkloadKind.COMMAND
    args = tuple(command[start:])
    for length in (2, 1):
        kind = _BY_SUBCOMMAND.get(args[:length])
        if kind is not None:
            return kind
    return WorkloadKind.COMMAND


def option_value(command: Sequence[str], option: str) -> str | None:
    """The value of `--option VALUE` or `--option=VALUE` in an argv, if present."""
    for index, arg in enumerate(command):
        if arg == option and index + 1 < len(command):
            return command[index + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


def check_workload(workload: Workload, command: Sequence[str], replicas: int) -> None:
    """Refuse a command its workload cannot run, naming the value and what would be accepted."""
    if replicas > 1 and not workload.gang:
        raise ConfigError(
            f"the {workload.kind.value} workload runs one process; replicas = {replicas} is only for "
            f"{', '.join(w.kind.value for w in WORKLOADS.values() if w.gang)} workloads"
        )
    if workload.subcommand and recognize(command) is not workload.kind:
        wanted = " ".join(("tether", *workload.subcommand))
        raise ConfigError(
            f"the {workload.kind.value} workload runs `{wanted} ...`; got {' '.join(command)!r}"
        )
    if workload.port_per_replica and option_value(command, "--port") is not None:
        raise ConfigError(
            f"the {workload.kind.value} workload gives each replica its own --port; "
            "drop --port from the command"
        )
    if (
        workload.resumable
        and option_value(command, "--config") is None
        and option_value(command, "--resume") is None
    ):
        raise ConfigError(
            f"the {workload.kind.value} workload needs `--config FILE` or `--resume RUN_DIR` in its command "
            f"(got {' '.join(command)!r}); a preempted one resumes from its run directory"
        )
