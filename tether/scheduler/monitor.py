"""Step times of a running gang's replicas, read from their metrics files, fed to the straggler detector.

Each replica appends JSON lines to its own metrics file (`metrics.jsonl`, as `tether train` writes
them); a line's `time/step_s` is one step's wall time. The watch reads only what was appended since
its last poll and ignores lines without a step time or not yet complete. It decides nothing itself:
the supervisor asks the back end what the straggler mitigation does about the replicas it flags.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tether.scheduler.straggler import StragglerConfig, StragglerDetector

STEP_KEY = "time/step_s"


class MetricsTail:
    """New step times appended to one metrics file since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def read(self) -> list[float]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self._offset += len(complete)
        times = []
        for line in complete.splitlines():
            try:
                value = json.loads(line).get(STEP_KEY)
            except (json.JSONDecodeError, AttributeError):
                continue
            if isinstance(value, int | float) and value > 0:
                times.append(float(value))
        return times


@dataclass(frozen=True, slots=True)
class Flagged:
    replicas: tuple[int, ...]
    slowdown: float  # the slowest flagged replica's median step over the others' median


class StragglerWatch:
    def __init__(self, paths: Sequence[Path], config: StragglerConfig) -> None:
        self.tails = [MetricsTail(path) for path in paths]
        self.detector = StragglerDetector(config)
        self._recent: list[list[float]] = [[] for _ in paths]
        self.window = config.window_steps

    def poll(self) -> Flagged | None:
        """Read the files; the replicas flagged now, or None."""
        for replica, tail in enumerate(self.tails):
            for step_s in tail.read():
                self.detector.report("job", replica, step_s)
                self._recent[replica] = [*self._recent[replica], step_s][-self.window :]
        flagged = self.detector.stragglers("job")
        if not flagged:
            return None
        others = [statistics.median(t) for r, t in enumerate(self._recent) if r not in flagged and t]
        slowest = max(statistics.median(self._recent[r]) for r in flagged)
        return Flagged(tuple(flagged), slowest / statistics.median(others) if others else 1.0)
