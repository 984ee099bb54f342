"""How a version's weights reach a fleet of rollout servers (`[rollout] weight_sync`): a safetensors folder
each server loads, or for SGLang a broadcast over a process group spanning the trainer and the fleet.

The broadcast follows SGLang's documented protocol ("Update weights from distributed" in its native API;
the request fields of `InitWeightsUpdateGroupReqInput` and `UpdateWeightsFromDistributedReqInput` in
`sglang/srt/managers/io_struct.py`): `POST /init_weights_update_group {master_address, master_port,
rank_offset, world_size, group_name, backend}` makes the server join a process group whose rank 0 is the
trainer, and each `POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache,
weight_version}` makes it receive those tensors, in that order, by broadcasts from rank 0. Both requests
stay open while the server sits in the collective, so the trainer's side of it runs concurrently with the
HTTP calls (in a thread), never after them.

One group spans the trainer and the whole fleet (server i is rank 1 + i): each tensor is broadcast once,
in the engines' dtype, to every server. The server forms its group with torch's own helper (SGLang's
`init_custom_process_group`: a `tcp://` rendezvous, then `_new_process_group_helper`); the trainer builds
the same group from public types, on a store it hosts, so it registers nothing in torch's global state.
Not covered: tensor-parallel servers (tp_size ranks each), and vLLM: its weight-transfer endpoints
(`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`;
docs.vllm.ai "Weight Transfer" and `vllm.distributed.weight_transfer.nccl_common`) broadcast through a
`PyNcclCommunicator` over vLLM's `StatelessProcessGroup`, NCCL on CUDA only, not a torch group that gloo
could stand in for on CPU; its servers load safetensors folders.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# torch.distributed.TCPStore and friends, documented there; typed stubs export them from here only.
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from tether.engine.weight_sync import SyncBackend, standalone_backend
from tether.rl.server_errors import ServerError
from tether.rl.servers import RolloutServer, Tensors


@dataclass(frozen=True, slots=True)
class SafetensorsDirTransport:
    """Writes each version to `root/v{version}/model.safetensors` (in `dtype`, unset: as given); the servers
    must see `root` at the same path (a shared or local disk). Tensor names must be the servers' (Hugging
    Face) parameter names. `keep_only` deletes the versions no server can still be asked to load."""

    root: Path
    dtype: torch.dtype | None = None

    def folder(self, version: int) -> Path:
        return self.root.absolute() / f"v{version}"

    async def send(self, tensors: Tensors, version: int) -> str:
        """Write `version`'s tensors; returns the folder (absolute: the servers resolve it, not us)."""
        from safetensors.torch import save_file

        folder = self.folder(version)
        contiguous = {
            name: tensor.detach().to(device="cpu", dtype=self.dtype or tensor.dtype).contiguous()
            for name, tensor in tensors
        }
        await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(save_file, contiguous, str(folder / "model.safetensors"))
        return str(folder)

    async def deliver(
        self, servers: Sequence[RolloutServer], tensors: Tensors, version: int
    ) -> list[Exception | None]:
        """Write `version` once; every server loads it. Returns each server's failure (None: loaded)."""
        return await update_fleet(servers, tensors, await self.send(tensors, version), version)

    async def reload(self, server: RolloutServer, tensors: Tensors, version: int) -> None:
        """`server` loads `version` from its folder (written by `deliver`) again, or for the first time:
        a server coming back to the fleet. `tensors` only name them (meta tensors do)."""
        await server.update_weights(tensors, str(self.folder(version)), version, reload=True)

    def keep_only(self, version: int) -> None:
        """Delete every version folder but `version`'s: once every server loaded it, no older one is read
        again (a resumed run pushes its version anew). Other files under `root` are left alone."""
        if not self.root.is_dir():
            return
        for entry in self.root.iterdir():
            if entry.is_dir() and re.fullmatch(r"v\d+", entry.name) and entry.name != f"v{version}":
                shutil.rmtree(entry)


async def update_fleet(
    servers: Sequence[RolloutServer], tensors: Tensors, location: str | WeightsGroup, version: int
) -> list[Exception | None]:
    """Every server loads `location` as `version`; returns each one's failure (None: loaded). Not
    cancelled when one fails (a server left halfway through a load holds unknown weights): all finish."""
    outcomes = await asyncio.gather(
        *(server.update_weights(tensors, location, version) for server in servers), return_exceptions=True
    )
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
            raise outcome  # cancelled or interrupted: not a server's failure
    return [outcome if isinstance(outcome, Exception) else None for outcome in outcomes]


@dataclass(frozen=True, slots=True)
class WeightsGroup:
    """Where and how servers join the broadcast group: the body of `/init_weights_update_group`, less
    each server's `rank_offset`."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: SyncBackend


def form_group(store: Store, rank: int, group: WeightsGroup, timeout: timedelta) -> Any:
    """The group's backend as torch's `_new_process_group_helper` makes it, on the same keys: its store
    prefixes are the group name (SGLang's), then "<group name>/", then its first device's ("cpu/" for
    gloo, which then serves every device; "cuda/" for NCCL); a sequence number is agreed on the store."""
    prefix = PrefixStore(f"{group.group_name}/", PrefixStore(group.group_name, store))
    device = "cpu/" if group.backend is SyncBackend.GLOO else "cuda/"
    backend = standalone_backend(PrefixStore(device, prefix), rank, group.world_size, group.backend, timeout)
    backend._set_sequence_number_for_group()
    return backend


class CollectiveTransport:
    """Rank 0 of the fleet's group: joins with every server on the first update, then broadcasts each
    version's tensors while every server's `/update_weights_from_distributed` request is open."""

    def __init__(self, host: str, backend: SyncBackend, timeout_s: float) -> None:
        self.host = host
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s)
        self.group: WeightsGroup | None = None
        self._store: TCPStore | None = None
        self._data: Any = None  # the backend the buckets travel on
        self._broken: str | None = None

    async def deliver(
        self, servers: Sequence[RolloutServer], tensors: Tensors, version: int
    ) -> list[Exception | None]:
        """Every server holds `version` (`tensors` as given, in the servers' dtype) on return; the fleet
        moves as one, since the group spans all of it: one server's failure is raised (the group is
        then unusable), never returned."""
        if self._broken is not None:
            raise ServerError(
                f"the weight broadcast group is unusable since an update failed: {self._broken}"
            )
        if self.group is None:
            await self._connect(servers)
        assert self.group is not None
        if len(servers) != self.group.world_size - 1:
            raise ServerError(
                f"a weight broadcast reaches the whole fleet of {self.group.world_size - 1} servers; "
                f"{len(servers)} of them were to load version {version} (a server removed from the fleet "
                "cannot rejoin its group: use rollout.weight_sync = 'safetensors' to fail over)"
            )
        cast = [(name, tensor.detach().to(self.backend.device)) for name, tensor in tensors]
        try:
            await _together(
                asyncio.to_thread(self._broadcast, cast),
                _all_loaded(servers, cast, self.group, version),
            )
        except BaseException as error:
            self._broken = str(error) or type(error).__name__
            raise
        return [None] * len(servers)

    async def reload(self, server: RolloutServer, tensors: Tensors, version: int) -> None:
        raise ServerError(
            f"{server.url} left the fleet, and a weight broadcast group cannot take a server back: it "
            "spans the fleet as it was formed; use rollout.weight_sync = 'safetensors' to fail over"
        )

    def keep_only(self, version: int) -> None:
        """Nothing to delete: no version outlives its broadcast."""

    async def _connect(self, servers: Sequence[RolloutServer]) -> None:
        world_size = 1 + len(servers)
        self._store = TCPStore(self.host, 0, world_size, True, timeout=self.timeout, wait_for_workers=False)
        group = WeightsGroup(
            self.host, self._store.port, world_size, f"tether-weights-{uuid.uuid4().hex[:8]}", self.backend
        )
        store = self._store
        backend, _ = await _together(
            asyncio.to_thread(form_group, store, 0, group, self.timeout),
            asyncio.gather(*(server.join_group(group, 1 + index) for index, server in enumerate(servers))),
        )
        self._data = backend
        self.group = group

    def _broadcast(self, tensors: Tensors) -> None:
        for _, tensor in tensors:
            options = dist.BroadcastOptions()
            options.rootRank = 0
            try:
                self._data.broadcast([tensor.contiguous()], options).wait(self.timeout)
            except RuntimeError as error:  # gloo and NCCL report a dead or slow peer this way
                raise ServerError(f"the weight broadcast to the servers failed: {error}") from None


async def _all_loaded(
    servers: Sequence[RolloutServer], tensors: Tensors, location: WeightsGroup, version: int
) -> None:
    for failure in await update_fleet(servers, tensors, location, version):
        if failure is not None:
            raise failure


async def _together(thread: Any, requests: Any) -> tuple[Any, Any]:
    """Run the trainer's side of a collective (`thread`) and the servers' HTTP calls at once; both are
    awaited to the end (a half-finished collective must not be abandoned). A server's failure is raised
    first: it says why the broadcast then found no peer."""
    outcomes = await asyncio.gather(thread, requests, return_exceptions=True)
    for outcome in reversed(outcomes):
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes[0], outcomes[1]
