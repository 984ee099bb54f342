"""Sample transcripts of a run (`transcripts.jsonl`: the trainer keeps a few rollouts of every step with
their prompt, reward, components and QC violation), newest first, filtered by domain, reward range and
QC violation, a page at a time. The filter is checked before any file is read; a bad value names itself.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from tether.console.errors import bad_input

PAGE_SIZE = 10
MAX_PAGE = 1_000_000


class QcFilter(StrEnum):
    ANY = "any"
    VIOLATIONS = "violations"  # only rollouts that broke a rule of their environment
    CLEAN = "clean"


@dataclass(frozen=True, slots=True)
class TranscriptFilter:
    domain: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    qc: QcFilter = QcFilter.ANY
    page: int = 1

    @classmethod
    def parse(
        cls,
        domain: str | None,
        min_reward: str | None,
        max_reward: str | None,
        qc: str | None,
        page: str | None,
    ) -> TranscriptFilter:
        """The filter from a query string as the page's form sends it (an empty field: no bound)."""
        if qc and qc not in QcFilter._value2member_map_:
            raise bad_input(f"qc {qc!r} is not one of {', '.join(QcFilter)}", "qc")
        number = _page(page)
        return cls(
            domain or None,
            _reward(min_reward, "min_reward"),
            _reward(max_reward, "max_reward"),
            QcFilter(qc) if qc else QcFilter.ANY,
            number,
        )

    def check(self, domains: Sequence[str]) -> TranscriptFilter:
        """This filter, or a 400 naming the bad value (`domains`: the run's own)."""
        if self.domain is not None and self.domain not in domains:
            known = ", ".join(domains) or "none recorded yet"
            raise bad_input(f"domain {self.domain!r} is not one of this run's ({known})", "domain")
        if self.min_reward is not None and self.max_reward is not None and self.min_reward > self.max_reward:
            raise bad_input(
                f"min_reward {self.min_reward} is above max_reward {self.max_reward}", "min_reward"
            )
        return self

    def is_empty(self) -> bool:
        """Whether every row passes."""
        return (
            self.domain is None
            and self.min_reward is None
            and self.max_reward is None
            and self.qc is QcFilter.ANY
        )

    def admits(self, row: dict[str, Any]) -> bool:
        reward = row.get("reward")
        if self.domain is not None and row.get("env") != self.domain:
            return False
        if self.min_reward is not None and not (
            isinstance(reward, int | float) and reward >= self.min_reward
        ):
            return False
        if self.max_reward is not None and not (
            isinstance(reward, int | float) and reward <= self.max_reward
        ):
            return False
        violated = row.get("qc_violation") is not None
        return self.qc is QcFilter.ANY or violated == (self.qc is QcFilter.VIOLATIONS)

    def query(self, page: int | None = None) -> dict[str, str]:
        """The filter as the query parameters of its URL (for the pager's links)."""
        given = {
            "domain": self.domain,
            "min_reward": self.min_reward,
            "max_reward": self.max_reward,
            "qc": self.qc.value if self.qc is not QcFilter.ANY else None,
            "page": page if page is not None else self.page,
        }
        return {key: str(value) for key, value in given.items() if value is not None}


def _reward(text: str | None, name: str) -> float | None:
    if text is None or not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise bad_input(f"{name} {text!r} is not a number (e.g. 0.5)", name)
    return value


def _page(text: str | None) -> int:
    if text is None or not text.strip():
        return 1
    if not text.strip().isdigit() or not 1 <= int(text) <= MAX_PAGE:
        raise bad_input(f"page {text!r} is not a page number (1 to {MAX_PAGE})", "page")
    return int(text)


@dataclass(frozen=True, slots=True)
class TranscriptPage:
    rows: list[dict[str, Any]]
    page: int
    matching: int  # rows that pass the filter, on every page
    page_size: int = PAGE_SIZE

    @property
    def pages(self) -> int:
        return max(1, -(-self.matching // self.page_size))

    def to_dict(self) -> dict[str, Any]:
        return {"page": self.page, "pages": self.pages, "matching": self.matching, "transcripts": self.rows}


def transcript_page(
    path: Path,
    chosen: TranscriptFilter,
    page_size: int = PAGE_SIZE,
    shape: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> TranscriptPage:
    """The `chosen.page`-th page of the rows that pass the filter, newest step first (`shape`: turns a
    line of another file, e.g. an eval's episode, into a transcript row first). Only the page's rows are
    kept whole; a half-written last line is skipped."""
    try:
        lines = path.read_bytes().split(b"\n")[
            :-1
        ]  # after the last newline: nothing, or a line being written
    except OSError:
        lines = []
    first = (chosen.page - 1) * page_size
    kept: list[dict[str, Any]] = []
    matching = 0
    unfiltered = chosen.is_empty()
    for line in reversed(lines):
        if not line.strip():
            continue
        if unfiltered and not first <= matching < first + page_size:
            matching += 1  # only the page's rows need parsing when every row passes
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if shape is not None:
            row = shape(row)
        if not chosen.admits(row):
            continue
        if first <= matching < first + page_size:
            kept.append(row)
        matching += 1
    return TranscriptPage(kept, chosen.page, matching, page_size)
