"""Weights to engine processes over torch.distributed: a versioned, bucketed broadcast from one sender
(rank 0, the learner's side) to N engines (ranks 1..N), each applying it under its own update policy.

The group stands alone: a `TCPStore` hosted by the sender and a `ProcessGroupGloo` (CPU) or
`ProcessGroupNCCL` (CUDA) built on it, so it coexists with any default group a learner process has. The
store is the control plane (what comes next, each engine's answer), the group the data plane (buckets).
Per update the sender posts a plan (version, dtype, names, shapes, bucket layout); every engine checks it
against its model and answers; only when all accept do the buckets travel, flattened in the engines' dtype
(the sender casts), and each engine (`weight_receiver.py`) hands the unflattened tensors to its engine,
whose `UpdatePolicy` decides what happens to requests in flight, so none is lost. A refused plan moves
no bytes and changes no engine. Every wait has a timeout: a dead peer is an error, not a hang. Not
covered: engines of different dtypes in one group, or engines that shard a tensor (each holds whole ones).
"""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

# torch.distributed.TCPStore and friends, documented there; typed stubs export them from here only.
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from tether.engine.model_runner import WeightUpdateError
from tether.engine.weight_buckets import UpdatePlan, parse_dtype, plan_update
from tether.engine.weight_update import NamedTensors
from tether.errors import ConfigError, TetherError

logger = logging.getLogger(__name__)

GROUP_PREFIX = "tether-weight-sync"
"""Namespace of the process group's own keys in the store, apart from the control messages."""


class SyncBackend(Enum):
    GLOO = "gloo"
    """CPU buckets: engines on CPU (or a CUDA engine that copies from host memory)."""
    NCCL = "nccl"
    """CUDA buckets on each rank's current device."""

    @property
    def device(self) -> torch.device:
        if self is SyncBackend.NCCL:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


class WeightSyncError(TetherError):
    """An update that some engine refused, failed to apply or never answered; names each engine's reason."""


@dataclass(frozen=True, slots=True)
class WeightSyncConfig:
    num_engines: int = 1
    """Engine processes in the group (ranks 1..num_engines; the sender is rank 0)."""
    host: str = "127.0.0.1"
    """Where the sender hosts the group's store."""
    port: int = 0
    """The store's port: 0 lets the sender pick a free one (`WeightSender.port`), which engines are given."""
    backend: SyncBackend | str = SyncBackend.GLOO
    """Accepts the enum or its value; stored as the enum."""
    bucket_mib: float = 64.0
    """Most bytes per broadcast (a larger tensor travels alone): bounds the sender's extra memory."""
    timeout_s: float = 120.0
    """Longest wait for a peer: joining the group, an engine's answer, one bucket."""
    poll_s: float = 0.01
    """How often an idle engine looks for the next message."""

    def __post_init__(self) -> None:
        engines = self.num_engines
        if isinstance(engines, bool) or not isinstance(engines, int) or engines < 1:
            raise ConfigError(f"weight sync: num_engines = {engines!r}: expected an integer of at least 1")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"weight sync: port = {self.port!r}: expected an integer in 0..65535")
        positive = {"bucket_mib": self.bucket_mib, "timeout_s": self.timeout_s, "poll_s": self.poll_s}
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ConfigError(f"weight sync: {name} = {value!r}: expected a finite number > 0")
        try:
            backend = SyncBackend(self.backend)
        except ValueError:
            accepted = ", ".join(repr(b.value) for b in SyncBackend)
            raise ConfigError(
                f"weight sync: backend = {self.backend!r}: expected one of {accepted}"
            ) from None
        object.__setattr__(self, "backend", backend)

    @property
    def sync_backend(self) -> SyncBackend:
        assert isinstance(self.backend, SyncBackend)
        return self.backend

    @property
    def world_size(self) -> int:
        return self.num_engines + 1


# --- the group -------------------------------------------------------------------------------------------


def standalone_backend(
    store: Store, rank: int, world_size: int, backend: SyncBackend, timeout: timedelta
) -> Any:
    """A gloo (CPU) or NCCL (CUDA) backend of `world_size` ranks on `store`, outside torch's default group;
    constructing it waits until every rank has joined."""
    if backend is SyncBackend.GLOO:
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from CPU builds of torch
    if nccl is None or not torch.cuda.is_available():
        raise ConfigError("weight sync: backend = 'nccl' needs CUDA and a torch built with NCCL")
    options = nccl.Options()
    options._timeout = timeout
    return nccl(store, rank, world_size, options)


def join_group(config: WeightSyncConfig, store: Store, rank: int) -> Any:
    """The data plane's backend on `store`; constructing it waits until every rank has joined."""
    timeout = timedelta(seconds=config.timeout_s)
    try:
        return standalone_backend(
            PrefixStore(GROUP_PREFIX, store), rank, config.world_size, config.sync_backend, timeout
        )
    except RuntimeError as error:  # torch's DistError: a rank missing or unreachable
        raise WeightSyncError(
            f"weight sync rank {rank}: the group of {config.world_size} ranks at {config.host}:"
            f"{config.port} did not form within {config.timeout_s:g} s: {error}"
        ) from None


def broadcast_bucket(group: Any, tensor: torch.Tensor) -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


def finish_bucket(work: Any, config: WeightSyncConfig, rank: int) -> None:
    try:
        work.wait(timedelta(seconds=config.timeout_s))
    except RuntimeError as error:  # gloo and NCCL report a dead or slow peer this way
        raise WeightSyncError(f"weight sync rank {rank}: a bucket's broadcast failed: {error}") from None


def wait_key(store: Store, key: str, timeout_s: float) -> str | None:
    """The value of `key` once set, or None after `timeout_s`."""
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except dist.DistStoreError:
        return None
    value: bytes = store.get(key)
    return value.decode()


def take_key(store: Store, key: str, timeout_s: float) -> str | None:
    """`wait_key`, then the key is deleted: for answers that one reader takes."""
    value = wait_key(store, key, timeout_s)
    if value is not None:
        store.delete_key(key)
    return value


# --- the sender ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SyncStats:
    version: int
    num_tensors: int
    num_buckets: int
    nbytes: int
    """Bytes broadcast (in the engines' dtype)."""
    seconds: float
    """From posting the plan to every engine holding the tensors."""


class WeightSender:
    """Rank 0: hosts the store at once (`port`), joins the group on `connect()` (which waits for every
    engine), then `send(named_tensors, version)` each version; `close()` releases the engines' threads."""

    def __init__(self, config: WeightSyncConfig) -> None:
        self.config = config
        self._store = TCPStore(
            config.host,
            config.port,
            config.world_size,
            True,
            timeout=timedelta(seconds=config.timeout_s),
            wait_for_workers=False,
        )
        self.port: int = self._store.port
        self.dtype: torch.dtype | None = None
        """The engines' dtype, learned on `connect()`: what every bucket is cast to."""
        self._group: Any = None
        self._seq = 0  # control messages posted so far
        self._sent: dict[int, int] = {}  # version -> message number, until its application is confirmed
        self._staging = [torch.empty(0), torch.empty(0)]  # the buckets being packed and travelling

    def connect(self) -> None:
        self._group = join_group(self.config, self._store, 0)
        hellos = self._answers("engine", "join the group")
        dtypes = {rank: json.loads(hello)["dtype"] for rank, hello in hellos.items()}
        if len(set(dtypes.values())) > 1:
            reason = f"the engines hold different dtypes, {dtypes} by rank; one broadcast cannot serve them"
            self.close(reason)
            raise ConfigError(f"weight sync: {reason}")
        self.dtype = parse_dtype(next(iter(dtypes.values())))

    def send(self, named_tensors: NamedTensors, version: int) -> SyncStats:
        """Every engine holds `version` when this returns (applied, or queued behind its in-flight requests
        under `wait`: see `wait_applied`). A refused update raises `WeightSyncError` and changes nothing."""
        start = time.perf_counter()
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        if not items:
            raise WeightUpdateError("a weight update needs at least one named tensor; got none")
        for name, tensor in items:
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise WeightUpdateError(f"parameter {name!r}: expected a floating-point tensor, got {kind}")
        if self._group is None or self.dtype is None:
            raise WeightSyncError("weight sync: send() before connect() or after close()")
        plan = plan_update(
            [(name, tuple(t.shape)) for name, t in items],
            version,
            self.dtype,
            int(self.config.bucket_mib * 2**20),
        )
        seq = self._post(plan.to_message())
        try:
            refusals = self._reasons(seq, "ack", f"check version {version}")
        except WeightSyncError:
            self._store.set(f"go/{seq}", "abort")  # the engines that did answer need not wait in vain
            raise
        self._store.delete_key(f"msg/{seq}")  # every engine has read it
        # Refused: the engines wait for this word before they go back to waiting for messages; the key
        # stays (a few bytes), since nothing says when the last engine has read it.
        self._store.set(f"go/{seq}", "abort" if refusals else "go")
        if refusals:
            raise WeightSyncError(f"weight sync: version {version} refused, nothing changed: {refusals}")
        self._broadcast(plan, dict(items))
        failures = self._reasons(seq, "received", f"receive version {version}")
        self._store.delete_key(f"go/{seq}")
        if failures:
            raise WeightSyncError(f"weight sync: version {version} not taken by every engine: {failures}")
        self._sent[version] = seq
        return SyncStats(version, len(items), len(plan.buckets), plan.nbytes, time.perf_counter() - start)

    def wait_applied(self, version: int) -> None:
        """Until every engine serves `version` (at once, except under `wait` with requests in flight)."""
        seq = self._sent.pop(version, None)
        if seq is None:
            raise WeightSyncError(f"weight sync: version {version} was not sent (or was already waited for)")
        failures = self._reasons(seq, "applied", f"apply version {version}")
        if failures:
            raise WeightSyncError(f"weight sync: version {version} failed to apply: {failures}")

    def close(self, reason: str = "") -> None:
        """Tell every engine's thread to stop, wait briefly for them, then drop the group and the store."""
        self._post({"close": reason})
        deadline = time.monotonic() + min(self.config.timeout_s, 5.0)
        for rank in self._ranks:  # an engine already gone does not answer
            take_key(self._store, f"bye/{rank}", max(deadline - time.monotonic(), 0.001))
        self._group = None

    @property
    def _ranks(self) -> range:
        return range(1, self.config.world_size)

    def _post(self, message: dict[str, Any]) -> int:
        seq, self._seq = self._seq, self._seq + 1
        self._store.set(f"msg/{seq}", json.dumps(message))
        return seq

    def _answers(self, kind: str, what: str) -> dict[int, str]:
        """Every engine's answer under `kind/<rank>`, each taken from the store; one timeout for them all,
        past which the error names every engine still silent."""
        deadline = time.monotonic() + self.config.timeout_s
        answers = {
            rank: take_key(self._store, f"{kind}/{rank}", max(deadline - time.monotonic(), 0.001))
            for rank in self._ranks
        }
        silent = [rank for rank, answer in answers.items() if answer is None]
        if silent:
            raise WeightSyncError(
                f"weight sync: engine rank(s) {silent} did not {what} within {self.config.timeout_s:g} s"
            )
        return {rank: answer for rank, answer in answers.items() if answer is not None}

    def _reasons(self, seq: int, kind: str, what: str) -> dict[int, str]:
        """The engines' answers to message `seq` that are reasons (an empty answer means done)."""
        answers = self._answers(f"{kind}/{seq}", what)
        return {rank: f"engine rank {rank}: {answer}" for rank, answer in answers.items() if answer}

    def _broadcast(self, plan: UpdatePlan, tensors: dict[str, torch.Tensor]) -> None:
        """Pack a bucket while the previous one travels, into two staging buffers kept between updates
        (fresh memory would cost a page fault per page on every update)."""
        device = self.config.sync_backend.device
        largest = max(plan.bucket_numels)
        for index, buffer in enumerate(self._staging):
            if buffer.dtype != plan.dtype or buffer.device != device or buffer.numel() < largest:
                self._staging[index] = torch.empty(0, dtype=plan.dtype, device=device)
        in_flight: collections.deque[Any] = collections.deque()
        for index, (bucket, numel) in enumerate(zip(plan.buckets, plan.bucket_numels, strict=True)):
            parts = [
                tensors[slot.name].detach().reshape(-1).to(device=device, dtype=plan.dtype) for slot in bucket
            ]
            if len(parts) == 1 and parts[0].is_contiguous():
                flat = parts[0]  # a whole bucket already as it travels: no copy
            else:
                if self._staging[index % 2].numel() < numel:
                    self._staging[index % 2] = torch.empty(largest, dtype=plan.dtype, device=device)
                # Free: the broadcast that last used this buffer was waited for below.
                flat = torch.cat(parts, out=self._staging[index % 2][:numel])
            in_flight.append(broadcast_bucket(self._group, flat))
            if len(in_flight) > 1:
                finish_bucket(in_flight.popleft(), self.config, 0)
        for work in in_flight:
            finish_bucket(work, self.config, 0)
