"""Atomic checkpoints of a run: model, optimizer, scheduler, trainer cursors and RNG states.

The learner's model and optimizer go through `torch.distributed.checkpoint` (`state/`): each rank of a
sharded learner writes its own shards, and a checkpoint loads at any world size (2 ranks -> 1, 1 -> 2),
since it records every tensor's global shape and the pieces each file holds. With `async_checkpoint`
the state is copied at once and written by a background thread while training goes on; the checkpoint
stays under its `.tmp` name until that write has finished (`PendingCheckpoint.wait`). A checkpoint (plus
`extra.pt`: what else the trainer must carry, e.g. async weight snapshots) is
written into `checkpoints/step-NNNNNN.tmp/`, fsynced, then renamed to its final name,
and only then does the `checkpoints/latest` pointer (itself replaced atomically) name it: a run killed
at any instant leaves either the previous checkpoint or the new one, never half of one. Metrics lines
after the checkpoint's step are dropped on resume, since those steps run again.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tether.errors import ConfigError
from tether.models.checkpoints import LATEST, STATE, checkpoint_tensors  # the layout the engine reads


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int  # steps completed
    path: Path
    trainer: dict[str, Any]  # cursors, policy version...: JSON-serialisable trainer state


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointable(Protocol):
    """What checkpoints a learner: its model, optimizer and schedule, into and out of a directory.
    `save_state` may return before the files are written: then its future completes when they are."""

    def save_state(self, directory: Path) -> Future[Any] | None: ...

    def load_state(self, directory: Path) -> None: ...


@contextmanager
def _one_process_quietly(alone: bool) -> Iterator[None]:
    """DCP warns at every save and load outside a process group that it assumes one process: here,
    that is what is meant."""
    with warnings.catch_warnings():
        if alone:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _is_coordinator() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_learner_state(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    asynchronous: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> Future[Any] | None:
    """`model` (what trains) and `optimizer` into `directory/state`, the schedule into `scheduler.pt`.
    Every rank of a sharded learner calls it (each writes its shards); a single process writes all.
    `asynchronous`: the state is copied now and written by a background thread (the returned future;
    on rank 0 it completes once every rank's files and the metadata are written). A sharded learner
    gives that thread its own `process_group`, so its collectives never interleave with training's."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    if _is_coordinator():
        torch.save(scheduler.state_dict(), directory / "scheduler.pt")
    alone = not dist.is_initialized()
    with _one_process_quietly(alone):
        if asynchronous:
            future = dcp_async_save(
                state, checkpoint_id=directory / STATE, process_group=process_group, no_dist=alone
            )
            assert isinstance(future, Future), "the thread checkpointer returns a future"
            return future
        dcp_save(state, checkpoint_id=directory / STATE, process_group=process_group, no_dist=alone)
    return None


def load_learner_state(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """What `save_learner_state` wrote, resharded to this learner's layout (any world size)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)  # this layout: what to fill
    # Loaded in place: the tensors of these dicts are filled (DTensor shards read the pieces they need).
    alone = not dist.is_initialized()
    with _one_process_quietly(alone):
        dcp_load(
            {"model": model_state, "optimizer": optimizer_state},
            checkpoint_id=directory / STATE,
            no_dist=alone,
        )
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    scheduler.load_state_dict(torch.load(directory / "scheduler.pt"))


def saved_model(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model tensors a checkpoint holds, by name, on the CPU: what trains (LoRA:
    the adapters), for inspection or export, whatever world size wrote it."""
    return checkpoint_tensors(checkpoint_dir)


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    for folder in [path, *(p for p in path.rglob("*") if p.is_dir())]:
        _fsync_dir(folder)


@dataclass(slots=True)
class PendingCheckpoint:
    """A checkpoint whose files may still be being written (`tmp`); `wait` makes it the latest."""

    tmp: Path
    final: Path
    keep: int
    writing: Future[Any] | None  # the learner state's background write, if any

    def wait(self) -> Path:
        """Wait for the files, then fsync, rename to the final name, point `latest` at it, rotate."""
        if self.writing is not None:
            self.writing.result()
            self.writing = None
        root = self.final.parent
        _fsync_tree(self.tmp)
        shutil.rmtree(self.final, ignore_errors=True)  # a re-save of a step (run end after a periodic one)
        os.replace(self.tmp, self.final)
        _fsync_dir(root)
        _write_atomic(root / LATEST, self.final.name + "\n")
        for old in sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))[
            : -self.keep
        ]:
            shutil.rmtree(old, ignore_errors=True)
        return self.final


def start_checkpoint(
    run_dir: Path,
    step: int,
    learner: Checkpointable,
    trainer: dict[str, Any],
    keep: int = 2,
    extra: dict[str, Any] | None = None,
) -> PendingCheckpoint:
    """Write a checkpoint into `step-NNNNNN.tmp/`; it becomes visible only when `wait` renames it, so a
    process killed before then (during a background write too) leaves the previous one as the latest."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("step-*.tmp"):  # left by a process killed mid-save: never visible, now dropped
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f"step-{step:06d}.tmp"
    tmp.mkdir()
    writing = learner.save_state(tmp)
    torch.save(rng_state(), tmp / "rng.pt")
    torch.save(extra or {}, tmp / "extra.pt")
    (tmp / "trainer.json").write_text(json.dumps({"step": step, **trainer}, indent=2) + "\n")
    return PendingCheckpoint(tmp, root / f"step-{step:06d}", keep, writing)


def save_checkpoint(
    run_dir: Path,
    step: int,
    learner: Checkpointable,
    trainer: dict[str, Any],
    keep: int = 2,
    extra: dict[str, Any] | None = None,
) -> Path:
    """`start_checkpoint`, then wait for it: the checkpoint is the latest when this returns."""
    return start_checkpoint(run_dir, step, learner, trainer, keep, extra).wait()


def has_checkpoint(run_dir: Path) -> bool:
    """Whether a checkpoint of this run was committed (a run killed during its first one has none)."""
    return (run_dir / "checkpoints" / LATEST).is_file()


def latest_checkpoint(run_dir: Path) -> Checkpoint:
    pointer = run_dir / "checkpoints" / LATEST
    if not pointer.is_file():
        raise ConfigError(
            f"run directory {str(run_dir)!r} has no checkpoint to resume from ({pointer} missing)"
        )
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    meta = json.loads((path / "trainer.json").read_text())
    return Checkpoint(step=int(meta.pop("step")), path=path, trainer=meta)


def load_checkpoint(checkpoint: Checkpoint, learner: Checkpointable) -> None:
    if not (checkpoint.path / STATE).is_dir():
        raise ConfigError(
            f"checkpoint {str(checkpoint.path)!r} has no {STATE}/ folder: it was written by an older tether "
            "(model.pt), which this one cannot resume"
        )
    learner.load_state(checkpoint.path)
    restore_rng(torch.load(checkpoint.path / "rng.pt", weights_only=False))


def load_extra(checkpoint: Checkpoint) -> dict[str, Any]:
    """The trainer's extra state (async: weight snapshots by version); empty for older checkpoints."""
    path = checkpoint.path / "extra.pt"
    extra: dict[str, Any] = torch.load(path, weights_only=False) if path.is_file() else {}
    return extra


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the metrics lines of steps <= `step` (later ones are repeated after a resume)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    _write_atomic(path, "".join(line + "\n" for line in kept))
