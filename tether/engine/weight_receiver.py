"""The engine's end of weight sync (`weight_sync.py`): a rank of the group that checks each plan against its
model, receives the buckets and hands the tensors to its engine, whose update policy then governs the
requests in flight. Beside a serving `AsyncEngine` it runs a thread; an `LLMEngine` driven by its caller
takes one message per `receive()`. It never changes the model itself and knows nothing of learners.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any

import torch

# torch.distributed.TCPStore, documented there; typed stubs export it from here only.
from torch._C._distributed_c10d import TCPStore

from tether.engine.async_engine import AsyncEngine, EngineStoppedError
from tether.engine.llm_engine import LLMEngine
from tether.engine.model_runner import WeightUpdateError
from tether.engine.weight_buckets import UpdatePlan, dtype_name
from tether.engine.weight_sync import (
    SyncBackend,
    WeightSyncConfig,
    WeightSyncError,
    broadcast_bucket,
    finish_bucket,
    join_group,
    wait_key,
)
from tether.engine.weight_update import check_named_tensors, check_version, parameter_shapes
from tether.errors import ConfigError

logger = logging.getLogger(__name__)


class WeightReceiver:
    """Rank `rank` of the group, in an engine process; joins on construction (waiting for the others).

    Beside an `AsyncEngine` serving requests, `start()` runs a thread that hands each version to it until
    the sender closes the group or `close()`; an engine driven by its caller (an `LLMEngine` in an actor,
    between generate calls) takes one message per `receive()` instead. A refused update is logged and kept
    in `refusals`; the engine serves on."""

    def __init__(self, engine: AsyncEngine | LLMEngine, config: WeightSyncConfig, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= config.num_engines:
            raise ConfigError(
                f"weight sync: engine rank = {rank!r}: expected an integer in 1..{config.num_engines}"
            )
        self.engine = engine
        self._llm = engine.engine if isinstance(engine, AsyncEngine) else engine
        self.config = config
        self.rank = rank
        model = self._llm.runner.model
        self.shapes = parameter_shapes(model)
        parameter = next(p for p in model.parameters() if p.is_floating_point())
        self.dtype = parameter.dtype
        self.device = config.sync_backend.device
        if config.sync_backend is SyncBackend.NCCL:
            if parameter.device.type != "cuda":
                raise ConfigError(
                    f"weight sync: backend = 'nccl' needs a CUDA engine; it is on {parameter.device}"
                )
            self.device = parameter.device  # buckets land on the engine's own GPU
        self.refusals: list[str] = []
        """Why each refused update was refused, oldest first."""
        self.error: BaseException | None = None
        """Why the thread stopped, if the group failed rather than closed."""
        self.closed = False
        """The sender has closed the group."""
        self._store = TCPStore(
            config.host, config.port, config.world_size, False, timeout=timedelta(seconds=config.timeout_s)
        )
        self._group = join_group(config, self._store, rank)
        self._store.set(f"engine/{rank}", json.dumps({"dtype": dtype_name(self.dtype)}))
        self._seq = 0  # the next message's number
        self._latest = self._llm.latest_version  # newest version handed to the engine from here
        self._applying: list[tuple[int, concurrent.futures.Future[int]]] = []
        self._buffers: list[torch.Tensor] = []  # the last update's buckets
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tether-weight-sync-{rank}", daemon=True)

    def start(self) -> None:
        if not isinstance(self.engine, AsyncEngine):
            raise ConfigError(
                "weight sync: a receiver thread needs an AsyncEngine; drive an LLMEngine by receive()"
            )
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def receive(self, timeout_s: float | None = None) -> int | None:
        """Take the next message in the caller's thread: the version now in the engine, or None when the
        sender refused it or closed the group. Waits up to `timeout_s` (default: the group's timeout)."""
        if self._thread.is_alive():
            raise WeightSyncError(f"weight sync rank {self.rank}: its thread already takes every message")
        if self.closed:
            return None
        wait_s = self.config.timeout_s if timeout_s is None else timeout_s
        message = self._next(time.monotonic() + wait_s)
        if message is None:
            raise WeightSyncError(
                f"weight sync rank {self.rank}: no message from the sender within {wait_s:g} s"
            )
        version = self._handle(message)
        self._report_applied()
        return version

    def _run(self) -> None:
        try:
            while not self.closed and (message := self._next(None)) is not None:
                self._handle(message)
        except BaseException as error:
            logger.exception("weight sync rank %d stopped", self.rank)
            self.error = error

    def _next(self, deadline: float | None) -> dict[str, Any] | None:
        """The next message, reporting applied updates while waiting; None after `deadline` (monotonic
        seconds) or once `close()` was called."""
        key = f"msg/{self._seq}"
        while not self._stopping.is_set() and (deadline is None or time.monotonic() < deadline):
            self._report_applied()
            if self._store.check([key]):
                self._seq += 1
                message: dict[str, Any] = json.loads(self._store.get(key).decode())
                return message
            time.sleep(self.config.poll_s)
        return None

    def _handle(self, message: dict[str, Any]) -> int | None:
        if "close" in message:
            self._store.set(f"bye/{self.rank}", message["close"])
            self.closed = True
            return None
        return self._update(self._seq - 1, UpdatePlan.from_message(message))

    def _update(self, seq: int, plan: UpdatePlan) -> int | None:
        refusal = self._refusal(plan)
        if refusal:  # on record before the sender hears of it
            logger.warning("weight sync rank %d refused version %d: %s", self.rank, plan.version, refusal)
            self.refusals.append(refusal)
        self._store.set(f"ack/{seq}/{self.rank}", refusal)
        go = wait_key(self._store, f"go/{seq}", self.config.timeout_s)
        if go is None:
            raise WeightSyncError(
                f"weight sync rank {self.rank}: no word from the sender on version "
                f"{plan.version} within {self.config.timeout_s:g} s"
            )
        if go != "go":
            return None  # some engine refused: no bucket travels
        buffers = self._buffers_for(plan)
        for work in [broadcast_bucket(self._group, buffer) for buffer in buffers]:
            finish_bucket(work, self.config, self.rank)
        if self.device.type == "cuda":  # NCCL's wait orders streams only: the engine's thread reads next
            torch.cuda.synchronize(self.device)
        named = [
            (slot.name, buffer[slot.offset : slot.offset + slot.numel].view(slot.shape))
            for bucket, buffer in zip(plan.buckets, buffers, strict=True)
            for slot in bucket
        ]
        try:
            done = self._submit(named, plan.version)
        except EngineStoppedError as error:
            self._store.set(f"received/{seq}/{self.rank}", f"the engine stopped: {error}")
            raise
        self._latest = plan.version
        self._applying.append((seq, done))
        self._buffers = buffers
        self._store.set(f"received/{seq}/{self.rank}", "")
        return plan.version

    def _submit(self, named: list[tuple[str, torch.Tensor]], version: int) -> concurrent.futures.Future[int]:
        """Hand the update to the engine; the future resolves once applied (an `LLMEngine`, driven from
        this thread, takes it at once: applied, or queued on a private copy under `wait`)."""
        if isinstance(self.engine, AsyncEngine):
            return self.engine.submit_weights(named, version)
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        try:
            self.engine.update_weights(named, version)
        except WeightUpdateError as error:
            done.set_exception(error)
        else:
            done.set_result(version)
        return done

    def _buffers_for(self, plan: UpdatePlan) -> list[torch.Tensor]:
        """The last update's buckets again when they fit and the engine is done with them (it copies
        tensors into the model or into its queue before it resolves an update); fresh ones otherwise."""
        numels = plan.bucket_numels
        last = self._buffers
        fits = [b.numel() for b in last] == numels and all(b.dtype == plan.dtype for b in last)
        if fits and all(done.done() for _, done in self._applying):
            return last
        return [torch.empty(n, dtype=plan.dtype, device=self.device) for n in numels]

    def _refusal(self, plan: UpdatePlan) -> str:
        """Why this engine cannot take `plan` ('' when it can), judged before any bucket travels."""
        if plan.dtype != self.dtype:
            sent, held = dtype_name(plan.dtype), dtype_name(self.dtype)
            return f"version {plan.version} is sent as {sent}, the engine holds {held}"
        try:
            check_version(plan.version, max(self._latest, self._llm.latest_version))
            meta = [(s.name, torch.empty(s.shape, dtype=plan.dtype, device="meta")) for s in plan.slots]
            check_named_tensors(self.shapes, meta)
        except WeightUpdateError as error:
            return str(error)
        return ""

    def _report_applied(self) -> None:
        for seq, done in [entry for entry in self._applying if entry[1].done()]:
            error = done.exception()
            self._store.set(f"applied/{seq}/{self.rank}", "" if error is None else f"{error}")
        self._applying = [entry for entry in self._applying if not entry[1].done()]
