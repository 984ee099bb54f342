"""The outcome of a run, and the pure rules that turn raw process outcomes into a status."""

from __future__ import annotations

import signal
from enum import StrEnum

from pydantic import BaseModel, Field

from tether.sandbox.cgroups import CgroupStats
from tether.sandbox.protocol import StepOutcome


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
