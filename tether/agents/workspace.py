"""`SandboxWorkspace`: an agent's working directory in a sandbox session, with snapshot and restore.

A snapshot is a deterministic tar of the whole workdir (sorted names, zero mtimes and owners), so the
same files always give the same bytes and the content-addressed artifact store keeps them once. The
tar is built and unpacked inside the sandbox; the host only moves bytes, never interprets paths.
"""

from __future__ import annotations

from tether.errors import TetherError
from tether.sandbox.result import RunResult, RunStatus
from tether.sandbox.session import SandboxSession

SNAPSHOT_NAME = ".tether-snapshot.tar"
_PACK = (
    f"tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --exclude=./{SNAPSHOT_NAME} "
    f"-cf {SNAPSHOT_NAME} ."
)
_UNPACK = f"tar -xf {SNAPSHOT_NAME} && rm -f {SNAPSHOT_NAME}"


class WorkspaceError(TetherError):
    """Snapshotting or restoring the working directory failed."""


class SandboxWorkspace:
    def __init__(self, session: SandboxSession) -> None:
        self.session = session

    async def run(self, code: str, language: str) -> RunResult:
        return await self.session.run(code, language=language)

    async def write_file(self, path: str, content: str) -> None:
        await self.session.upload({path: content})

    async def read_file(self, path: str) -> bytes:
        return (await self.session.download([path]))[path]

    async def _must(self, command: str, what: str) -> None:
        result = await self.session.run(command, language="bash")
        if result.status is not RunStatus.OK:
            raise WorkspaceError(f"{what} failed ({result.status}): {result.stderr[-500:]}")

    async def snapshot(self) -> bytes:
        await self._must(_PACK, "workdir snapshot")
        data = (await self.session.download([SNAPSHOT_NAME]))[SNAPSHOT_NAME]
        await self._must(f"rm -f {SNAPSHOT_NAME}", "removing the snapshot file")
        return data

    async def restore(self, data: bytes) -> None:
        await self.session.upload({SNAPSHOT_NAME: data})
        await self._must(_UNPACK, "workdir restore")
