"""The outcome of a run, and the pure rules that turn raw process outcomes into a status."""

from __future__ import annotations

import signal
from enum import StrEnum

from pydantic import BaseModel, Field

from tether.sandbox import protocol
from tether.sandbox.cgroups import CgroupStats
from tether.sandbox.protocol import RunReply, StepOutcome


class RunStatus(StrEnum):
    OK = "ok"
    RUNTIME_ERROR = "runtime_error"
    COMPILE_ERROR = "compile_error"
    TIMEOUT = "timeout"
    MEMORY_LIMIT = "memory_limit"
    OUTPUT_LIMIT = "output_limit"
    KILLED = "killed"
    SANDBOX_ERROR = "sandbox_error"


class RunStage(StrEnum):
    """The step whose outcome decided a run's status."""

    COMPILE = "compile"
    RUN = "run"


class QcStatus(StrEnum):
    PASSED = "passed"
    FAILED = "failed"


class CompileOutput(BaseModel):
    exit_code: int | None
    stdout: str
    stderr: str
    wall_ms: float


class RunResult(BaseModel):
    status: RunStatus
    stage: RunStage = RunStage.RUN
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_ms: float = 0.0
    cpu_ms: float = 0.0
    peak_memory_kib: int = 0
    files: dict[str, str] = Field(default_factory=dict, description="Collected files, base64-encoded.")
    missing_files: list[str] = Field(default_factory=list)
    compile: CompileOutput | None = None
    qc: QcStatus = QcStatus.PASSED
    qc_detail: list[str] = Field(default_factory=list)
    error: str | None = None
    worker: str | None = None


def classify(outcome: StepOutcome, stats: CgroupStats, *, is_compile: bool = False) -> RunStatus:
    """Status of one step. Memory kills come from the cgroup's OOM counter, never from the exit code."""
    if outcome.setup_error:
        return RunStatus.SANDBOX_ERROR
    if stats.oom_kills > 0:
        return RunStatus.MEMORY_LIMIT
    if outcome.timed_out or outcome.signal == signal.SIGXCPU:
        return RunStatus.TIMEOUT
    if outcome.output_exceeded:
        return RunStatus.OUTPUT_LIMIT
    if is_compile:
        return RunStatus.OK if outcome.exit_code == 0 else RunStatus.COMPILE_ERROR
    if outcome.signal == signal.SIGKILL:
        return RunStatus.KILLED
    if outcome.exit_code == 0:
        return RunStatus.OK
    return RunStatus.RUNTIME_ERROR


def assemble(
    reply: RunReply | None, stats: list[CgroupStats], compiled: bool, error: str | None
) -> RunResult:
    """One result from a worker's reply and each step's cgroup figures (pure)."""
    if reply is None or reply.error:
        return RunResult(status=RunStatus.SANDBOX_ERROR, error=error or (reply.error if reply else None))
    empty = CgroupStats(0, 0)
    compile_output = None
    outcomes = list(reply.steps)
    step_stats = stats or [empty] * len(outcomes)
    if compiled and outcomes:
        first = outcomes.pop(0)
        first_stats = step_stats.pop(0) if step_stats else empty
        compile_output = CompileOutput(
            exit_code=first.exit_code,
            stdout=protocol.b64decode(first.stdout_b64).decode(errors="replace"),
            stderr=protocol.b64decode(first.stderr_b64).decode(errors="replace"),
            wall_ms=first.wall_ms,
        )
        status = classify(first, first_stats, is_compile=True)
        if status is not RunStatus.OK:
            return RunResult(
                status=status,
                stage=RunStage.COMPILE,
                compile=compile_output,
                error=first.setup_error,
                exit_code=first.exit_code,
            )
    if not outcomes:
        return RunResult(
            status=RunStatus.SANDBOX_ERROR, error="the run step did not execute", compile=compile_output
        )
    outcome, outcome_stats = outcomes[0], (step_stats[0] if step_stats else empty)
    return RunResult(
        status=classify(outcome, outcome_stats),
        exit_code=outcome.exit_code,
        signal=outcome.signal,
        stdout=protocol.b64decode(outcome.stdout_b64).decode(errors="replace"),
        stderr=protocol.b64decode(outcome.stderr_b64).decode(errors="replace"),
        stdout_truncated=outcome.stdout_truncated,
        stderr_truncated=outcome.stderr_truncated,
        wall_ms=round(outcome.wall_ms, 3),
        cpu_ms=round(outcome.cpu_ms, 3),
        peak_memory_kib=outcome_stats.peak_memory_kib,
        files=reply.files,
        missing_files=reply.missing_files,
        compile=compile_output,
        error=outcome.setup_error,
    )
