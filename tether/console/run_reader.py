"""Runs as the console sees them: the run directories of `tether train`/`tether demo` under the console's
run roots, read from the files the trainer writes (`config.toml`, `metrics.jsonl`, `cost.json`,
`evaluation.json`, `warnings.jsonl`, `checkpoints/latest`), with the readers of `tether.rl`.

A run's status is decided from those files alone; nothing here talks to a training process:
- finished: the last metrics row reached `run.steps` and `cost.json` (rewritten at the end of
  `Trainer.run`) counts that many steps;
- running: not finished, and some file of the run was written within `stale_after_s` (or five of its
  recent steps, whichever is longer);
- stopped: quiet, and the latest checkpoint and `cost.json` are at the last recorded step (a stop request
  checkpoints the step it finished before it returns);
- failed: quiet at any other point (a crash leaves steps after its last checkpoint, or none at all).
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from tether.console.errors import bad_input, not_found
from tether.models.checkpoints import LATEST
from tether.rl.cost import COST_FILE
from tether.rl.monitors import WARNINGS_FILE
from tether.rl.report import EVALUATION, Row

METRICS = "metrics.jsonl"
TRANSCRIPTS = "transcripts.jsonl"
CONFIG = "config.toml"
# Files the trainer (re)writes while it trains: the newest of their times is the run's last sign of life.
WRITTEN = (METRICS, TRANSCRIPTS, CONFIG, COST_FILE, WARNINGS_FILE, f"checkpoints/{LATEST}")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
STALE_AFTER_S = 120.0  # how long a run may write nothing before it is no longer called running


class RunKind(StrEnum):
    TRAIN = "train"  # a run directory of `tether train` / `tether demo`
    EVAL = "eval"  # the episodes and summary files of one `tether eval`


class RunStatus(StrEnum):
    RUNNING = "running"
    FINISHED = "finished"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class RunSummary:
    name: str
    path: Path
    status: RunStatus
    step: int  # steps recorded in metrics.jsonl
    steps: int | None  # `run.steps` of its config.toml (None: unreadable)
    reward: float | None  # the last step's mean reward
    started_at: float | None  # when config.toml was written (the run started or resumed)
    updated_at: float | None  # the newest write of any of its files
    kind: RunKind = RunKind.TRAIN

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind.value,
            "path": str(self.path),
            "status": self.status.value,
            "step": self.step,
            "steps": self.steps,
            "reward": self.reward,
            "started_at": self.started_at,
            "updated_at": self.updated_at,
        }


def check_name(name: str) -> str:
    """A run's name as it appears in a URL: one directory name, never a path out of the run roots."""
    if ".." in name or not NAME.fullmatch(name):
        raise bad_input(
            f"run name {name!r} is not a run directory's name "
            "(letters, digits, '.', '_', '-'; no '..' or '/')",
            "name",
        )
    return name


def _is_run(path: Path) -> bool:
    return path.is_dir() and ((path / CONFIG).is_file() or (path / METRICS).is_file())


def run_dirs(roots: Sequence[Path]) -> list[Path]:
    """Every run directory under `roots`, the first of a name kept when two roots hold one."""
    seen: dict[str, Path] = {}
    for root in roots:
        if not root.is_dir():
            continue
        for child in sorted(root.iterdir()):
            if child.name not in seen and NAME.fullmatch(child.name) and _is_run(child):
                seen[child.name] = child
    return list(seen.values())


def find_run(roots: Sequence[Path], name: str) -> Path:
    check_name(name)
    for root in roots:
        if _is_run(root / name):
            return root / name
    where = ", ".join(str(root) for root in roots) or "no run roots"
    raise not_found("run", name, f"the runs are the directories under {where} (see /runs)")


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def last_row(path: Path) -> Row | None:
    """The last complete row of a JSON-lines file, read from its end (a half-written last line is
    skipped: the trainer appends whole lines, but a reader may arrive mid-write)."""
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            block = 1 << 16
            while True:
                start = max(0, size - block)
                handle.seek(start)
                lines = handle.read(size - start).split(b"\n")
                complete = lines[1:] if start > 0 else lines
                for line in reversed(complete):
                    if line.strip():
                        try:
                            row = json.loads(line)
                        except json.JSONDecodeError:
                            continue
                        if isinstance(row, dict):
                            return row
                if start == 0:
                    return None
                block *= 4
    except OSError:
        return None


def read_config(run_dir: Path) -> dict[str, Any]:
    """The run's `config.toml` as a dict (empty when it is missing or unreadable)."""
    try:
        return tomllib.loads((run_dir / CONFIG).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def read_json(path: Path) -> Any:
    """A JSON file of the run, or None when it is missing or half-written."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run's latest committed checkpoint (None: there is none)."""
    pointer = run_dir / "checkpoints" / LATEST
    try:
        meta = read_json(run_dir / "checkpoints" / pointer.read_text().strip() / "trainer.json")
    except OSError:
        return None
    return int(meta["step"]) if isinstance(meta, dict) and "step" in meta else None


def run_status(
    run_dir: Path, step: int, steps: int | None, updated_at: float | None, step_s: float, now: float
) -> RunStatus:
    cost = read_json(run_dir / COST_FILE)
    costed = int(cost["steps"]) if isinstance(cost, dict) and "steps" in cost else None
    if steps is not None and step >= steps and costed is not None and costed >= steps:
        return RunStatus.FINISHED
    quiet_s = max(STALE_AFTER_S, 5 * step_s)
    if updated_at is not None and now - updated_at < quiet_s:
        return RunStatus.RUNNING
    if step > 0 and costed == step and checkpoint_step(run_dir) == step:
        return RunStatus.STOPPED
    return RunStatus.FAILED


def _number(row: Row | None, key: str) -> float | None:
    value = row.get(key) if row else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def summarize_run(run_dir: Path, now: float, last: Row | None = None) -> RunSummary:
    """The list's line for a run: its status, step, latest reward and times (reads the last metrics row
    only, unless the caller already has it)."""
    last = last_row(run_dir / METRICS) if last is None else last
    configured = read_config(run_dir).get("run", {}).get("steps")
    steps = int(configured) if isinstance(configured, int) else None
    times = [t for t in (_mtime(run_dir / name) for name in WRITTEN) if t is not None]
    updated_at = max(times, default=_mtime(run_dir))
    step = int(_number(last, "step") or 0)
    step_s = _number(last, "time/step_s") or 0.0
    return RunSummary(
        name=run_dir.name,
        path=run_dir,
        status=run_status(run_dir, step, steps, updated_at, step_s, now),
        step=step,
        steps=steps,
        reward=_number(last, "reward"),
        started_at=_mtime(run_dir / CONFIG),
        updated_at=updated_at,
    )


def list_runs(roots: Sequence[Path], now: float) -> list[RunSummary]:
    """Every training run under `roots`."""
    return [summarize_run(path, now) for path in run_dirs(roots)]


@dataclass(frozen=True, slots=True)
class RunFiles:
    """All of a run the run page shows but its transcripts: read once per request."""

    summary: RunSummary
    rows: list[Row]
    config_text: str
    evaluation: list[dict[str, Any]]
    cost: dict[str, Any] | None
    warnings: list[dict[str, Any]]


def read_rows(path: Path, offset: int = 0) -> tuple[list[Row], int]:
    """The complete rows of a JSON-lines file from byte `offset` on, and the offset after the last of them
    (a line still being written is left for the next read). A file shorter than `offset` was rewritten (a
    resumed run drops the steps after its checkpoint): it is read again from the start."""
    try:
        with path.open("rb") as handle:
            if handle.seek(0, os.SEEK_END) < offset:
                offset = 0
            handle.seek(offset)
            data = handle.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    rows = []
    for line in data[:end].split(b"\n"):
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue  # a line no tether wrote (a disk full mid-line, a hand edit): the rest still shows
        if isinstance(row, dict):
            rows.append(row)
    return rows, offset + end


@dataclass(frozen=True, slots=True)
class _Read:
    inode: int
    offset: int
    rows: list[Row]


class MetricsCache:
    """The `metrics.jsonl` rows of each run read so far, so a request parses only the lines appended since
    the last one (a 1,000-step run's file is megabytes of JSON). A rewritten file (resume truncates it by
    replacing it) is read again. The lists it returns are never changed afterwards."""

    def __init__(self) -> None:
        self._reads: dict[Path, _Read] = {}

    def rows(self, run_dir: Path) -> list[Row]:
        path = run_dir / METRICS
        try:
            stat = path.stat()
        except OSError:
            self._reads.pop(path, None)
            return []
        known = self._reads.get(path)
        if known is None or known.inode != stat.st_ino or stat.st_size < known.offset:
            known = _Read(stat.st_ino, 0, [])
        if stat.st_size > known.offset:
            fresh, offset = read_rows(path, known.offset)
            known = _Read(stat.st_ino, offset, known.rows + fresh)
        self._reads[path] = known
        return known.rows


def read_run(run_dir: Path, now: float, rows: list[Row]) -> RunFiles:
    """The run page's files, given its metrics `rows` (`MetricsCache.rows`)."""
    evaluation = read_json(run_dir / EVALUATION)
    cost = read_json(run_dir / COST_FILE)
    try:
        config_text = (run_dir / CONFIG).read_text()
    except OSError:
        config_text = ""
    return RunFiles(
        summary=summarize_run(run_dir, now, rows[-1] if rows else None),
        rows=rows,
        config_text=config_text,
        evaluation=evaluation if isinstance(evaluation, list) else [],
        cost=cost if isinstance(cost, dict) else None,
        warnings=read_rows(run_dir / WARNINGS_FILE)[0],
    )
