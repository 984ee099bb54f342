"""`Sandbox` and `Session`: the one interface to the sandbox, whether it runs here or on a fleet.

`SandboxPool` (workers in this process's namespaces) and `SandboxFleet` (`tether sandbox serve`
instances over HTTP) both implement it; callers (scoring, tools, agents) see only these protocols and
get whichever `[sandbox]` configures (`factory.open_sandbox`). A session lives on one instance: when
that instance is gone its calls raise `SessionLost`, never hang, and the caller decides what to do
(agents restore the task's last snapshot into a new session).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, Self

from tether.errors import TetherError
from tether.sandbox.result import RunResult
from tether.sandbox.spec import SandboxSpec


class SessionLost(TetherError):
    """The instance holding a session is gone (refused, reset, restarted): its working directory is lost."""

    def __init__(self, session_id: str, instance: str, reason: str) -> None:
        super().__init__(
            f"sandbox session {session_id!r} is lost: its instance {instance} is gone ({reason}); "
            "open a new session and restore its files"
        )
        self.session_id, self.instance, self.reason = session_id, instance, reason


class Session(Protocol):
    """A working directory that persists across runs (`SandboxSession`, `FleetSession`)."""

    @property
    def id(self) -> str: ...

    async def run(
        self,
        code: str | bytes,
        language: str = "python",
        stdin: str | bytes = "",
        files: Mapping[str, str | bytes] | None = None,
        collect: Sequence[str] = (),
        spec: SandboxSpec | None = None,
    ) -> RunResult: ...

    async def upload(self, files: Mapping[str, str | bytes]) -> None: ...

    async def download(self, paths: Sequence[str]) -> dict[str, bytes]:
        """The files' bytes; a missing one raises FileNotFoundError."""
        ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc_info: object) -> None: ...


class Sandbox(Protocol):
    """Where code runs: `start`, then any number of `run`s and sessions, then `close`."""

    @property
    def spec(self) -> SandboxSpec:
        """The limits every run gets unless it passes its own."""
        ...

    async def start(self) -> None: ...

    async def run(
        self,
        code: str | bytes,
        language: str = "python",
        stdin: str | bytes = "",
        files: Mapping[str, str | bytes] | None = None,
        collect: Sequence[str] = (),
        spec: SandboxSpec | None = None,
        client: str = "",
        warm: bool = True,
    ) -> RunResult: ...

    async def open_session(self, spec: SandboxSpec | None = None, client: str = "") -> Session: ...

    async def close(self) -> None: ...
