"""`tether eval` outputs in the console's run roots, shown as runs of kind `eval`: the episodes file
`eval-<stamp>-<pid>.jsonl` (one `EpisodeRecord.to_dict()` per line, appended as each episode ends) and,
once every episode is done, its summary `eval-<stamp>-<pid>.json` beside it (see tether/cli/eval.py).

An eval is finished when its summary exists, running while its episodes file was written within
`STALE_AFTER_S`, and failed otherwise (the command died before it wrote the summary).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tether.console.run_reader import (
    STALE_AFTER_S,
    RunKind,
    RunStatus,
    RunSummary,
    read_json,
    read_rows,
)

EVAL_NAME = re.compile(r"eval-[0-9]{8}-[0-9]{6}-[0-9]+")


def eval_files(roots: Sequence[Path]) -> list[Path]:
    """The episodes file of every eval under `roots`, the first of a name kept."""
    seen: dict[str, Path] = {}
    for root in roots:
        if not root.is_dir():
            continue
        for path in sorted(root.glob("eval-*.jsonl")):
            if path.stem not in seen and EVAL_NAME.fullmatch(path.stem) and path.is_file():
                seen[path.stem] = path
    return list(seen.values())


def find_eval(roots: Sequence[Path], name: str) -> Path | None:
    """The episodes file of the eval called `name` (a checked run name), or None."""
    if not EVAL_NAME.fullmatch(name):
        return None
    for root in roots:
        if (root / f"{name}.jsonl").is_file():
            return root / f"{name}.jsonl"
    return None


def read_summary(episodes: Path) -> dict[str, Any] | None:
    """The eval's summary (None while it runs, or if it died before writing one)."""
    summary = read_json(episodes.with_suffix(".json"))
    return summary if isinstance(summary, dict) else None


def episode_row(record: dict[str, Any]) -> dict[str, Any]:
    """An episode in the shape of a training transcript (what the transcript filter and list read)."""
    score = record.get("score") or {}
    messages = record.get("transcript") or []
    replies = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
    asked = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    return {
        "step": None,
        "env": record.get("env"),
        "seed": record.get("seed"),
        "reward": record.get("reward"),
        "components": score.get("components") or {},
        "passed": record.get("passed", False),
        "qc_violation": score.get("qc_violation"),
        "prompt": asked[:1],
        "text": str(replies[-1].get("content") or "") if replies else "",
        "completion_tokens": record.get("completion_tokens"),
        "finish_reason": f"{record.get('turns', 0)} turns",
        "error": record.get("error"),
    }


def summarize_eval(episodes: Path, now: float) -> RunSummary:
    summary = read_summary(episodes)
    records, _ = read_rows(episodes)
    try:
        written = episodes.stat().st_mtime
    except OSError:
        written = None
    if summary is not None:
        status = RunStatus.FINISHED
        reward = summary.get("mean_reward")
    else:
        fresh = written is not None and now - written < STALE_AFTER_S
        status = RunStatus.RUNNING if fresh else RunStatus.FAILED
        rewards = [float(r.get("reward") or 0.0) for r in records]
        reward = sum(rewards) / len(rewards) if rewards else None
    total = summary.get("episodes") if summary else None
    return RunSummary(
        name=episodes.stem,
        path=episodes,
        status=status,
        step=len(records),
        steps=total if isinstance(total, int) else None,
        reward=reward,
        started_at=_started(episodes.stem),
        updated_at=max(
            (t for t in (written, _mtime(episodes.with_suffix(".json"))) if t is not None), default=None
        ),
        kind=RunKind.EVAL,
    )


def _started(name: str) -> float | None:
    # `tether eval` stamps the file with its local start time (time.strftime("%Y%m%d-%H%M%S")).
    try:
        return time.mktime(time.strptime(name[5:20], "%Y%m%d-%H%M%S"))
    except ValueError:
        return None


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def list_evals(roots: Sequence[Path], now: float) -> list[RunSummary]:
    return [summarize_eval(path, now) for path in eval_files(roots)]
