"""SandboxFusion's `run_code` schema and the mapping of our results onto it (pure, no I/O).

Field names and status values follow SandboxFusion's `sandbox/server/sandbox_api.py` and
`sandbox/runners/types.py`, so RL frameworks that speak to SandboxFusion can point at tether unchanged.
"""

from __future__ import annotations

import signal
from enum import StrEnum

from pydantic import BaseModel, Field

from tether.sandbox.result import RunResult, RunStage, RunStatus
from tether.sandbox.spec import UnicodeText


class FusionRunRequest(BaseModel):
    """SandboxFusion's `RunCodeRequest`. Like theirs, unknown fields are ignored rather than refused."""

    compile_timeout: float = 10
    run_timeout: float = 10
    memory_limit_MB: int = -1
    code: UnicodeText
    stdin: UnicodeText | None = None
    language: UnicodeText
    files: dict[UnicodeText, str | None] = Field(default_factory=dict)
    fetch_files: list[UnicodeText] = Field(default_factory=list)
    args: list[str] = Field(default_factory=list)  # pytest arguments; no accepted language uses them


class FusionCommandStatus(StrEnum):
    FINISHED = "Finished"
    ERROR = "Error"
    TIME_LIMIT_EXCEEDED = "TimeLimitExceeded"


class FusionRunStatus(StrEnum):
    SUCCESS = "Success"
    FAILED = "Failed"
    SANDBOX_ERROR = "SandboxError"


class FusionCommandResult(BaseModel):
    status: FusionCommandStatus
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class FusionRunResponse(BaseModel):
    status: FusionRunStatus
    message: str
    compile_result: FusionCommandResult | None = None
    run_result: FusionCommandResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


def fusion_command(
    status: RunStatus,
    exit_code: int | None,
    signal_number: int | None,
    stdout: str,
    stderr: str,
    wall_ms: float,
) -> FusionCommandResult:
    """One step as SandboxFusion reports it. A killed process gets the shell's code, 128 + signal."""
    if status is RunStatus.SANDBOX_ERROR:
        return FusionCommandResult(status=FusionCommandStatus.ERROR, stderr=stderr)
    if status is RunStatus.TIMEOUT:
        return FusionCommandResult(
            status=FusionCommandStatus.TIME_LIMIT_EXCEEDED,
            execution_time=wall_ms / 1000,
            stdout=stdout,
            stderr=stderr,
        )
    code = exit_code if exit_code is not None else 128 + (signal_number or signal.SIGKILL)
    return FusionCommandResult(
        status=FusionCommandStatus.FINISHED,
        execution_time=wall_ms / 1000,
        return_code=code,
        stdout=stdout,
        stderr=stderr,
    )


def failed_in_compile(result: RunResult) -> bool:
    """Whether the compile step decided the status (then the run step never started)."""
    return result.stage is RunStage.COMPILE


def to_fusion(result: RunResult, pod_name: str | None) -> FusionRunResponse:
    """Our result in SandboxFusion's terms, with their rule for the overall status (`parse_run_status`)."""
    in_compile = failed_in_compile(result)
    error = result.error or result.stderr
    compile_result = run_result = None
    if result.compile is not None:
        compiled = result.compile
        compile_status = result.status if in_compile else RunStatus.OK
        compile_stderr = error if compile_status is RunStatus.SANDBOX_ERROR else compiled.stderr
        compile_result = fusion_command(
            compile_status, compiled.exit_code, None, compiled.stdout, compile_stderr, compiled.wall_ms
        )
    if not in_compile:
        run_stderr = error if result.status is RunStatus.SANDBOX_ERROR else result.stderr
        run_result = fusion_command(
            result.status, result.exit_code, result.signal, result.stdout, run_stderr, result.wall_ms
        )
    steps = [step for step in (compile_result, run_result) if step is not None]
    status, message = FusionRunStatus.SUCCESS, ""
    errors = [step for step in steps if step.status is FusionCommandStatus.ERROR]
    if errors:
        status, message = FusionRunStatus.SANDBOX_ERROR, errors[0].stderr or ""
    elif any(s.status is FusionCommandStatus.TIME_LIMIT_EXCEEDED or s.return_code != 0 for s in steps):
        status = FusionRunStatus.FAILED
    return FusionRunResponse(
        status=status,
        message=message,
        compile_result=compile_result,
        run_result=run_result,
        executor_pod_name=pod_name,
        files=result.files,
    )
