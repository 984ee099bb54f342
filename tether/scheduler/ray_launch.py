"""Replicas on Ray: one actor per replica, scheduled into its bundle of the job's placement group.

The actor runs the replica's command as a subprocess (its own process group) with
`CUDA_VISIBLE_DEVICES` set from `ray.get_gpu_ids()`, the GPUs Ray gave the actor in that bundle (empty
for a CPU-only replica). `stop` sends SIGTERM to the group and SIGKILL after the grace period, so a
train job checkpoints before its actor is killed. Ray is imported only by `RayLauncher`.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tether.scheduler.job import Demand
from tether.scheduler.processes import signal_group, wait_group

BYTES_PER_MIB = 1024 * 1024


class ReplicaProcess:
    """The body of the replica actor (also usable directly, as the tests of its logic do)."""

    def __init__(
        self, command: Sequence[str], gpu_ids: Sequence[object] | None = None, log_path: str | None = None
    ) -> None:
        if gpu_ids is None:  # inside the actor: the GPUs Ray assigned it in its bundle
            gpu_ids = importlib.import_module("ray").get_gpu_ids()
        self.visible_devices = ",".join(str(int(str(g))) for g in gpu_ids)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": self.visible_devices}
        output = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (the child owns it)
        self.process = subprocess.Popen(
            list(command), stdin=subprocess.DEVNULL, stdout=output, stderr=output, env=env, process_group=0
        )

    def devices(self) -> str:
        return self.visible_devices

    def poll(self) -> int | None:
        return self.process.poll()

    def stop(self, grace_s: float) -> int:
        """SIGTERM the replica's group, SIGKILL it after `grace_s`; its exit status."""
        pgid = self.process.pid
        signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        signal_group(pgid, signal.SIGKILL)
        wait_group(pgid, grace_s)
        return self.process.wait()


class Launcher(Protocol):
    def start(self, group: Any, bundle: int, demand: Demand, command: Sequence[str]) -> Any: ...

    def poll(self, handle: Any) -> int | None: ...

    def devices(self, handle: Any) -> str: ...

    def stop(self, handle: Any, grace_s: float) -> None: ...


@dataclass
class RayLauncher:
    """Starts replica actors with `PlacementGroupSchedulingStrategy(group, bundle)`."""

    log_dir: str | None = None

    def __post_init__(self) -> None:
        self.ray = importlib.import_module("ray")
        strategies = importlib.import_module("ray.util.scheduling_strategies")
        self._strategy = strategies.PlacementGroupSchedulingStrategy

        self._actor = self.ray.remote(ReplicaProcess)

    def start(self, group: Any, bundle: int, demand: Demand, command: Sequence[str]) -> Any:
        options: dict[str, Any] = {
            "num_cpus": demand.cpus,
            "num_gpus": demand.accelerators,
            "scheduling_strategy": self._strategy(placement_group=group, placement_group_bundle_index=bundle),
        }
        if demand.memory_mib:
            options["memory"] = demand.memory_mib * BYTES_PER_MIB
        log = None if self.log_dir is None else os.path.join(self.log_dir, f"{group.id.hex()}-{bundle}.log")
        return self._actor.options(**options).remote(list(command), None, log)

    def poll(self, handle: Any) -> int | None:
        result: int | None = self.ray.get(handle.poll.remote())
        return result

    def devices(self, handle: Any) -> str:
        result: str = self.ray.get(handle.devices.remote())
        return result

    def stop(self, handle: Any, grace_s: float) -> None:
        try:
            self.ray.get(handle.stop.remote(grace_s), timeout=grace_s + 30)
        finally:
            self.ray.kill(handle)
