"""Where environments reach the sandbox, a run the sandbox failed is an `InfraError`, never a result the
model is scored on; the program's own failures (timeouts, crashes, memory) stay results."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.scoring import EpisodeState
from tether.envs.tasks import Task
from tether.errors import InfraError, InfraReason
from tether.sandbox.interface import SessionLost
from tether.sandbox.pool import NoFreeSlot
from tether.sandbox.result import QcStatus, RunResult, RunStatus
from tether.sandbox.session import SessionClosed
from tether.sandbox.spec import SandboxSpec
from tether.tools.workspace import SandboxWorkspace

SANDBOX_ERROR = RunResult(status=RunStatus.SANDBOX_ERROR, error="worker w1 failed: EOF")
QC_FAILED = RunResult(status=RunStatus.OK, qc=QcStatus.FAILED, qc_detail=["the worker process is gone"])


class _Session:
    """A session whose runs return `result`, or raise `raises`."""

    def __init__(self, result: RunResult, raises: Exception | None = None) -> None:
        self.result, self.raises = result, raises

    @property
    def id(self) -> str:
        return "s1"

    async def run(self, code: str | bytes, language: str = "python", **kwargs: Any) -> RunResult:
        if self.raises is not None:
            raise self.raises
        return self.result

    async def upload(self, files: Mapping[str, str | bytes]) -> None:
        return None

    async def download(self, paths: Sequence[str]) -> dict[str, bytes]:
        return {}

    async def close(self) -> None:
        return None


class _Sandbox:
    """A sandbox whose runs return `result` and whose sessions cannot open when `full`."""

    def __init__(self, result: RunResult, full: bool = False) -> None:
        self.result, self.full = result, full

    @property
    def spec(self) -> SandboxSpec:
        return SandboxSpec()

    async def start(self) -> None:
        return None

    async def run(self, code: str | bytes, language: str = "python", **kwargs: Any) -> RunResult:
        return self.result

    async def open_session(self, spec: SandboxSpec | None = None, client: str = "") -> _Session:
        if self.full:
            raise NoFreeSlot("no sandbox slot freed up within 30 s", retry_after_s=30)
        return _Session(self.result)

    async def close(self) -> None:
        return None


def _ctx(result: RunResult, full: bool = False) -> ScoringContext:
    return ScoringContext(SandboxProvider(pool=_Sandbox(result, full)))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("result", "reason", "message"),
    [
        (SANDBOX_ERROR, InfraReason.SANDBOX_ERROR, "could not run the program: worker w1 failed: EOF"),
        (QC_FAILED, InfraReason.SANDBOX_QC, "failed its quality check: the worker process is gone"),
    ],
)
async def test_a_run_the_sandbox_failed_is_an_infra_error(
    result: RunResult, reason: InfraReason, message: str
) -> None:
    with pytest.raises(InfraError, match=message) as failed:
        await _ctx(result).run("print(1)")
    assert failed.value.reason is reason


@pytest.mark.parametrize(
    "status", [RunStatus.TIMEOUT, RunStatus.RUNTIME_ERROR, RunStatus.MEMORY_LIMIT, RunStatus.KILLED]
)
async def test_the_programs_own_failures_stay_results(status: RunStatus) -> None:
    assert (await _ctx(RunResult(status=status)).run("while True: pass")).status is status


async def test_a_session_the_sandbox_cannot_open_is_an_infra_error() -> None:
    with pytest.raises(InfraError, match="NoFreeSlot: no sandbox slot") as failed:
        await _ctx(RunResult(status=RunStatus.OK), full=True).open_session()
    assert failed.value.reason is InfraReason.SANDBOX_ERROR


async def test_an_episodes_workspace_raises_for_sandbox_failures_and_a_hosted_one_shows_them() -> None:
    task = Task(env="test/x", seed=0, messages=[], reference="")
    state = EpisodeState(task, ScoringContext(), [], session=_Session(QC_FAILED))  # type: ignore[arg-type]
    with pytest.raises(InfraError, match="quality check") as failed:
        await state.run("ls", "bash")
    assert failed.value.reason is InfraReason.SANDBOX_QC
    hosted = SandboxWorkspace(_Session(SANDBOX_ERROR))  # type: ignore[arg-type]
    assert (await hosted.run("ls", "bash")).status is RunStatus.SANDBOX_ERROR  # the agent's model sees it
    lost = _Session(SANDBOX_ERROR, raises=SessionLost("s1", "http://sandbox-2", "connection refused"))
    with pytest.raises(InfraError, match="is lost") as gone:
        await SandboxWorkspace(lost, infra_errors=True).run("ls")  # type: ignore[arg-type]
    assert gone.value.reason is InfraReason.SANDBOX_ERROR
    # The sandbox closed the session after an unhealthy run: the episode's next run cannot be the model's.
    closed = _Session(SANDBOX_ERROR, raises=SessionClosed("session s1 is closed"))
    with pytest.raises(InfraError, match="is closed") as shut:
        await SandboxWorkspace(closed, infra_errors=True).run("ls")  # type: ignore[arg-type]
    assert shut.value.reason is InfraReason.SANDBOX_ERROR
