"""Workload kinds: tether's own commands recognized from the argv, and each replica's command built."""

from __future__ import annotations

import sys

import pytest

from tether.errors import ConfigError
from tether.scheduler.workload import TETHER, WORKLOADS, WorkloadKind, check_workload, recognize


@pytest.mark.parametrize(
    ("command", "kind"),
    [
        (["tether", "train", "--config", "x.toml"], WorkloadKind.TRAIN),
        (["/venv/bin/tether", "eval", "math/arithmetic"], WorkloadKind.EVAL),
        (["python3", "-m", "tether", "serve", "model"], WorkloadKind.SERVE),
        (["tether", "sandbox", "serve"], WorkloadKind.SANDBOX_FLEET),
        (["tether", "sandbox", "doctor"], WorkloadKind.COMMAND),
        (["python", "train.py"], WorkloadKind.COMMAND),
    ],
)
def test_tether_workloads_are_recognized_from_the_command(command: list[str], kind: WorkloadKind) -> None:
    assert recognize(command) is kind


def test_a_train_job_resumes_from_its_run_directory() -> None:
    train = WORKLOADS[WorkloadKind.TRAIN]
    command = ("tether", "train", "--config", "x.toml")
    assert train.replica_commands(command, 1, (), "/runs/x", resume=False) == [
        (*TETHER, "train", "--config", "x.toml")
    ]
    assert train.replica_commands(command, 1, (), "/runs/x", resume=True) == [
        (*TETHER, "train", "--resume", "/runs/x")
    ]


def test_each_sandbox_of_a_fleet_gets_its_own_port() -> None:
    fleet = WORKLOADS[WorkloadKind.SANDBOX_FLEET]
    commands = fleet.replica_commands(
        ("tether", "sandbox", "serve", "--slots", "2"), 2, (9001, 9002), "", False
    )
    assert commands == [
        (sys.executable, "-m", "tether", "sandbox", "serve", "--slots", "2", "--port", "9001"),
        (sys.executable, "-m", "tether", "sandbox", "serve", "--slots", "2", "--port", "9002"),
    ]


@pytest.mark.parametrize(
    ("kind", "command", "replicas", "message"),
    [
        (
            WorkloadKind.TRAIN,
            ["tether", "train", "--config", "x.toml"],
            2,
            "the train workload runs one process; replicas = 2",
        ),
        (WorkloadKind.TRAIN, ["tether", "train"], 1, "needs `--config FILE` or `--resume RUN_DIR`"),
        (WorkloadKind.SERVE, ["tether", "eval", "x"], 1, "the serve workload runs `tether serve ...`"),
        (WorkloadKind.SANDBOX_FLEET, ["tether", "sandbox", "serve", "--port", "80"], 2, "drop --port"),
    ],
)
def test_a_command_its_workload_cannot_run_is_refused(
    kind: WorkloadKind, command: list[str], replicas: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_workload(WORKLOADS[kind], command, replicas)
