"""Atomic checkpoints of a run: model, optimizer, scheduler, trainer cursors and RNG states.

A checkpoint (plus `extra.pt`: what else the trainer must carry, e.g. async weight snapshots) is
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tether.errors import ConfigError

LATEST = "latest"


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


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    trainer: dict[str, Any],
    keep: int = 2,
    extra: dict[str, Any] | None = None,
) -> Path:
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f"step-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(model.state_dict(), tmp / "model.pt")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    torch.save(extra or {}, tmp / "extra.pt")
    (tmp / "trainer.json").write_text(json.dumps({"step": step, **trainer}, indent=2) + "\n")
    for file in tmp.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)  # a re-save of the same step (end of run after a periodic one)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_atomic(root / LATEST, final.name + "\n")
    for old in sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Checkpoint:
    pointer = run_dir / "checkpoints" / LATEST
    if not pointer.is_file():
        raise ConfigError(
            f"run directory {str(run_dir)!r} has no checkpoint to resume from ({pointer} missing)"
        )
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    meta = json.loads((path / "trainer.json").read_text())
    return Checkpoint(step=int(meta.pop("step")), path=path, trainer=meta)


def load_checkpoint(
    checkpoint: Checkpoint,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    device = next(model.parameters()).device
    model.load_state_dict(torch.load(checkpoint.path / "model.pt", map_location=device))
    optimizer.load_state_dict(torch.load(checkpoint.path / "optimizer.pt", map_location=device))
    scheduler.load_state_dict(torch.load(checkpoint.path / "scheduler.pt"))
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
