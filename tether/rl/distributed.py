"""The learner's process group and device mesh on torch.distributed, and the ranks tether starts itself.

A `LearnerGroup` is this process's place among the learner ranks: its rank, the world size, its device
and a device mesh with one "dp" dimension (FSDP shards over it; a "tp" dimension can join it later). The
rendezvous comes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or
is given explicitly (a TCP address: ranks tether spawns itself, tests). Gloo on CPU, NCCL on CUDA; every
collective times out instead of hanging. This module knows nothing of models or training.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tether.errors import ConfigError
from tether.models.precision import resolve_device

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# How long a rank this process started may take to exit once told to stop (it only finishes a checkpoint
# write and leaves the group); one stuck in a collective that rank 0 abandoned is killed after it.
_CHILD_EXIT_S = 60.0


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where the ranks meet: this rank, how many there are, and the address (`tcp://` or `env://`)."""

    rank: int
    world_size: int
    init_method: str
    local_rank: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} outside a world of {self.world_size} learner ranks")

    @classmethod
    def from_env(cls, world_size: int) -> Rendezvous | None:
        """torchrun's rendezvous, checked against `learner.world_size`; None outside torchrun."""
        if "WORLD_SIZE" not in os.environ:
            return None
        missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
        if missing:
            raise ConfigError(f"WORLD_SIZE is set but {', '.join(missing)} is not: launch with torchrun")
        launched = int(os.environ["WORLD_SIZE"])
        if launched != world_size:
            raise ConfigError(
                f"torchrun started {launched} ranks (WORLD_SIZE) but learner.world_size = {world_size}: "
                f"make them equal (torchrun --nproc-per-node {world_size}, "
                f"or learner.world_size = {launched})"
            )
        return cls(int(os.environ["RANK"]), launched, "env://", int(os.environ.get("LOCAL_RANK", "0")))


def local_init_method(host: str = "127.0.0.1") -> str:
    """A TCP rendezvous on a free port of this machine at `host` (an address of this machine the other
    ranks reach: loopback for ranks started here, the node's IP for Ray learner actors)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    return f"tcp://{host}:{port}"


class LearnerGroup:
    """This process's rank of the learner: the default process group and the "dp" device mesh."""

    def __init__(
        self,
        rendezvous: Rendezvous,
        device: str,
        timeout_s: float,
        children: Sequence[BaseProcess] = (),
    ) -> None:
        self.children = list(children)  # ranks this process started (joined on close)
        if dist.is_initialized():
            raise ConfigError("a torch.distributed process group is already open in this process")
        where = resolve_device(device, "model.device")
        if where.type == "cuda":
            where = torch.device("cuda", rendezvous.local_rank)  # one GPU per rank, torchrun's numbering
            torch.cuda.set_device(where)
        self.device = where
        self.rank = rendezvous.rank
        self.world_size = rendezvous.world_size
        self.backend = "nccl" if where.type == "cuda" else "gloo"
        dist.init_process_group(
            self.backend,
            init_method=rendezvous.init_method,
            rank=rendezvous.rank,
            world_size=rendezvous.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        self.mesh: DeviceMesh = init_device_mesh(where.type, (self.world_size,), mesh_dim_names=("dp",))
        # Background checkpoint writes run collectives of their own: on a group of their own (gloo, on
        # the CPU copy of the state), they never interleave with the training step's.
        self.checkpoint_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    @property
    def is_coordinator(self) -> bool:
        """Rank 0: runs the trainer (rollouts, run directory) and tells the other ranks what to do."""
        return self.rank == 0

    def close(self) -> None:
        """Leave the process group; rank 0 of ranks it started waits for them to exit (killed if stuck)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        for child in self.children:
            child.join(_CHILD_EXIT_S)
            if child.is_alive():
                child.kill()
                child.join()
        self.children.clear()
