"""Faults injected into Ray rollout workers from the driver through files in the run directory (the one
channel a test and an actor process share): `arm_stall(run_dir)` makes the next `generate` call of one
worker stall (it claims the file and writes its pid), `stalled_pid(run_dir)` waits for that pid."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tether.rl.config import TrainConfig
from tether.rl.ray_actors import RolloutWorker
from tether.rl.rollout import PromptPlan
from tether.rl.sources import Generated

if TYPE_CHECKING:
    from tether.envs.context import SandboxProvider
    from tether.envs.registry import EnvRegistry

STALL_S = 3600.0  # longer than any test: the stalled call ends only when its actor is killed


def _faults(run_dir: Path) -> Path:
    return run_dir / "faults"


def arm_stall(run_dir: Path) -> None:
    _faults(run_dir).mkdir(parents=True, exist_ok=True)
    (_faults(run_dir) / "stall").touch()


def stalled_pid(run_dir: Path, timeout_s: float = 60.0) -> int:
    """The pid of the worker stalled by `arm_stall`, once one is."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        claimed = list(_faults(run_dir).glob("stalled-*"))
        if claimed:
            return int(claimed[0].name.removeprefix("stalled-"))
        time.sleep(0.05)
    raise AssertionError(f"no worker stalled within {timeout_s:g} s")


class StallingWorker(RolloutWorker):
    """A rollout worker whose `generate` stalls when it claims the run's armed stall (one worker, once)."""

    def __init__(
        self, config: TrainConfig, registry: EnvRegistry, sandbox: SandboxProvider | None, cpus: float
    ) -> None:
        super().__init__(config, registry, sandbox, cpus)
        self.run_dir = config.run_dir

    def generate(self, plans: list[PromptPlan]) -> Generated:
        faults = _faults(self.run_dir)
        try:
            os.rename(faults / "stall", faults / f"stalled-{os.getpid()}")
        except FileNotFoundError:
            return super().generate(plans)
        time.sleep(STALL_S)
        return super().generate(plans)
