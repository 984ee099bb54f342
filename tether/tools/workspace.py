"""The working directory tools act on: the `Workspace` protocol and `SandboxWorkspace`, its one
implementation over a sandbox session, with snapshot and restore for durable agents.

Every tool call of an RL episode and of a hosted agent runs here, so nothing a model wrote runs in this
process. A snapshot is a deterministic tar of the whole workdir (sorted names, zero mtimes and owners),
so the same files always give the same bytes and the content-addressed artifact store keeps them once.
The tar is built and unpacked inside the sandbox; the host only moves bytes, never interprets paths.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tether.errors import InfraError, InfraReason, TetherError
from tether.sandbox.interface import SessionLost
from tether.sandbox.result import QcStatus, RunResult, RunStatus
from tether.sandbox.session import SessionClosed

if TYPE_CHECKING:
    from tether.sandbox.interface import Session

T = TypeVar("T")
SNAPSHOT_NAME = ".tether-snapshot.tar"
_PACK = (
    f"tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --exclude=./{SNAPSHOT_NAME} "
    f"-cf {SNAPSHOT_NAME} ."
)
_UNPACK = f"tar -xf {SNAPSHOT_NAME} && rm -f {SNAPSHOT_NAME}"


class WorkspaceError(TetherError):
    """Snapshotting or restoring the working directory failed, or there is no working directory."""


class Workspace(Protocol):
    """What tools may do to the working directory."""

    async def run(self, code: str | bytes, language: str = "python", **kwargs: Any) -> RunResult: ...

    async def write_file(self, path: str, content: str) -> None: ...

    async def read_file(self, path: str) -> bytes: ...


def sound(result: RunResult) -> RunResult:
    """`result` when the sandbox ran the program soundly; an `InfraError` when it could not run it
    (`sandbox_error`) or the worker failed its quality check after the run (`sandbox_qc`). The program's
    own failures (it timed out, crashed, ran out of memory) are sound results: they are the model's."""
    if result.status is RunStatus.SANDBOX_ERROR:
        raise InfraError(InfraReason.SANDBOX_ERROR, f"the sandbox could not run the program: {result.error}")
    if result.qc is QcStatus.FAILED:
        why = "; ".join(result.qc_detail) or "no reason given"
        raise InfraError(
            InfraReason.SANDBOX_QC, f"sandbox worker {result.worker} failed its quality check: {why}"
        )
    return result


class Timer(Protocol):
    """Wraps sandbox work to account for its time (an episode's `ScoringContext.timed`)."""

    def __call__(self, work: Awaitable[T], /) -> Awaitable[T]: ...


async def _untimed(work: Awaitable[T]) -> T:
    return await work


class SandboxWorkspace:
    """A sandbox session's working directory; files persist between calls until the session closes.

    `infra_errors`: a run the sandbox failed (`sound`) or a lost session raises `InfraError`, so that RL
    episodes leave it out of the rewards; otherwise (hosted agents) the run's status is returned as it
    is, and the model sees it."""

    def __init__(self, session: Session, timed: Timer = _untimed, infra_errors: bool = False) -> None:
        self.session = session
        self._timed = timed
        self._infra_errors = infra_errors

    async def run(self, code: str | bytes, language: str = "python", **kwargs: Any) -> RunResult:
        """`Session.run` (same keyword arguments), timed."""
        if not self._infra_errors:
            return await self._timed(self.session.run(code, language=language, **kwargs))
        try:
            return sound(await self._timed(self.session.run(code, language=language, **kwargs)))
        except (SessionLost, SessionClosed) as lost:  # closed by the sandbox after an unhealthy run
            raise InfraError(InfraReason.SANDBOX_ERROR, str(lost)) from lost

    async def write_file(self, path: str, content: str) -> None:
        await self._timed(self.session.upload({path: content}))

    async def read_file(self, path: str) -> bytes:
        """The file's bytes; FileNotFoundError when it does not exist."""
        return (await self._timed(self.session.download([path])))[path]

    async def _must(self, command: str, what: str) -> None:
        result = await self.run(command, language="bash")
        if result.status is not RunStatus.OK:
            raise WorkspaceError(f"{what} failed ({result.status}): {result.stderr[-500:]}")

    async def snapshot(self) -> bytes:
        await self._must(_PACK, "workdir snapshot")
        data = await self.read_file(SNAPSHOT_NAME)
        await self._must(f"rm -f {SNAPSHOT_NAME}", "removing the snapshot file")
        return data

    async def restore(self, data: bytes) -> None:
        await self._timed(self.session.upload({SNAPSHOT_NAME: data}))
        await self._must(_UNPACK, "workdir restore")


class NoWorkspace:
    """The workspace of an episode that has no sandbox session: every use is refused."""

    def __init__(self, why: str) -> None:
        self.why = why

    async def run(self, code: str | bytes, language: str = "python", **kwargs: Any) -> RunResult:
        raise WorkspaceError(self.why)

    async def write_file(self, path: str, content: str) -> None:
        raise WorkspaceError(self.why)

    async def read_file(self, path: str) -> bytes:
        raise WorkspaceError(self.why)
