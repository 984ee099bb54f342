"""The last runs a sandbox server answered with anything but `ok` (or that failed the quality check), kept
in memory for operators (`GET /v1/recent-failures`, the console's sandboxes page). Bounded, so a server
that fails every run holds the same few hundred records; it holds no code, stdin or files, only what
tells the failures apart (status, stage, exit, the sandbox's own error and the tail of stderr)."""

from __future__ import annotations

from collections import deque

from pydantic import BaseModel

from tether.sandbox.result import QcStatus, RunResult, RunStage, RunStatus

STDERR_TAIL_CHARS = 300


class RecentFailure(BaseModel):
    at: float
    language: str
    status: RunStatus
    stage: RunStage
    exit_code: int | None
    signal: int | None
    wall_ms: float
    qc: QcStatus
    qc_detail: list[str]
    error: str | None
    stderr_tail: str
    worker: str | None


class RecentFailures:
    """The latest `keep` failed runs, newest first."""

    def __init__(self, keep: int = 100) -> None:
        assert keep > 0
        self._failures: deque[RecentFailure] = deque(maxlen=keep)

    def note(self, language: str, result: RunResult, at: float) -> None:
        if result.status is RunStatus.OK and result.qc is QcStatus.PASSED:
            return
        self._failures.append(
            RecentFailure(
                at=at,
                language=language,
                status=result.status,
                stage=result.stage,
                exit_code=result.exit_code,
                signal=result.signal,
                wall_ms=result.wall_ms,
                qc=result.qc,
                qc_detail=result.qc_detail,
                error=result.error,
                stderr_tail=result.stderr[-STDERR_TAIL_CHARS:],
                worker=result.worker,
            )
        )

    def latest(self, limit: int) -> list[RecentFailure]:
        return list(reversed(self._failures))[:limit]
