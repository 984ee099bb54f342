"""`SandboxSession`: a sandbox that keeps its working directory across many runs, for agents.

A session holds one worker and one slot of its pool for its whole life; its calls are serialised,
since the worker's control channel carries one exchange at a time. Each `run` is still a fresh
process in fresh PID/mount/IPC namespaces and fresh cgroups; only the session's tmpfs (workdir, /tmp,
/dev/shm, /mnt) persists. The workdir is the caller's alone: each run's program is written to
PROGRAM_DIR (`paths.py`), replaced by the next, and the workdir comes first on Python's import path.
Closing the session (or leaving it idle past its timeout) releases the tmpfs, checks the worker and
hands it back.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from tether.errors import TetherError
from tether.sandbox import protocol
from tether.sandbox.pool_config import SESSION_SEPARATOR
from tether.sandbox.protocol import RunRequest
from tether.sandbox.result import RunResult
from tether.sandbox.spec import SandboxSpec, checked_text, sandbox_path
from tether.sandbox.worker import Worker

if TYPE_CHECKING:
    from tether.sandbox.pool import SandboxPool


class SessionClosed(TetherError):
    """The session was closed, expired, or lost its worker."""


class SandboxSession:
    def __init__(
        self,
        pool: SandboxPool,
        worker: Worker,
        spec: SandboxSpec,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # The worker's directory key, and the id callers use: prefixed by the pool's instance name, if
        # any (`sandbox-0~s1f...`), so that whoever holds the id knows which instance holds the session.
        self.dir_id = f"s{uuid.uuid4().hex[:16]}"
        name = pool.config.instance_name
        self.id = f"{name}{SESSION_SEPARATOR}{self.dir_id}" if name else self.dir_id
        self.pool = pool
        self.spec = spec
        self._worker: Worker | None = worker
        self._clock = clock
        self.last_used = clock()
        self.runs = 0
        self._lock = asyncio.Lock()

    @property
    def closed(self) -> bool:
        return self._worker is None

    def _require_worker(self) -> Worker:
        if self._worker is None:
            raise SessionClosed(f"session {self.id} is closed")
        self.last_used = self._clock()
        return self._worker

    async def run(
        self,
        code: str | bytes,
        language: str = "python",
        stdin: str | bytes = "",
        files: Mapping[str, str | bytes] | None = None,
        collect: Sequence[str] = (),
        spec: SandboxSpec | None = None,
    ) -> RunResult:
        request, compiled = self.pool.build_request(
            code, language, stdin, files or {}, spec or self.spec, dir_id=self.dir_id, keep_dir=True
        )
        request.collect = [sandbox_path(path, "collect", self.pool.config.workdir) for path in collect]
        async with self._lock:
            worker = self._require_worker()
            result, healthy = await self.pool.execute(worker, request, spec or self.spec, compiled)
            self.runs += 1
            self.last_used = self._clock()  # a long run is not idleness
            if not healthy:
                self._discard()
        return result

    async def upload(self, files: Mapping[str, str | bytes]) -> None:
        request = RunRequest(
            dir_id=self.dir_id,
            disk_mib=self.spec.disk_mib,
            files={
                sandbox_path(name, "files", self.pool.config.workdir): protocol.b64encode(
                    checked_text(data, f"files[{name!r}]").encode() if isinstance(data, str) else data
                )
                for name, data in files.items()
            },
            steps=[],
            keep_dir=True,
        )
        async with self._lock:
            reply = await self._require_worker().run(request, [])
        if reply.error:
            raise TetherError(f"upload to session {self.id} failed: {reply.error}")

    async def download(self, paths: Sequence[str]) -> dict[str, bytes]:
        """Read files from the session's working directory; missing ones raise FileNotFoundError."""
        checked = [sandbox_path(path, "paths", self.pool.config.workdir) for path in paths]
        async with self._lock:
            files, missing = await self._require_worker().download(self.dir_id, checked)
        if missing:
            raise FileNotFoundError(f"not in session {self.id}: {', '.join(missing)}")
        return {name: protocol.b64decode(data) for name, data in files.items()}

    async def close(self) -> None:
        async with self._lock:
            if self._worker is None:
                return
            worker, self._worker = self._worker, None
            fingerprint = None
            try:
                fingerprint = await worker.release(self.dir_id)
            except (OSError, EOFError, RuntimeError):
                fingerprint = None
            finally:  # also when cancelled mid-release: the worker goes back, discarded unless it is clean
                self.pool.end_session(self, worker, healthy=fingerprint == worker.baseline_fingerprint)

    def _discard(self) -> None:
        if self._worker is None:
            return
        worker, self._worker = self._worker, None
        self.pool.end_session(self, worker, healthy=False)

    async def __aenter__(self) -> SandboxSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
