"""Where scoring and episodes reach the sandbox: one lazily started pool, and a timer per episode.

Pure-Python domains never touch it; domains that execute code (tests, graders, tools) go through a
`ScoringContext`, so nothing a model wrote ever runs in this process and the time spent in the sandbox
is reported per episode.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tether.envs.errors import EnvError

if TYPE_CHECKING:
    from tether.sandbox.pool import PoolConfig, SandboxPool
    from tether.sandbox.result import RunResult
    from tether.sandbox.session import SandboxSession
    from tether.sandbox.spec import SandboxSpec

T = TypeVar("T")


class SandboxProvider:
    """One `SandboxPool` shared by many scorings and episodes, started on first use and closed once."""

    def __init__(
        self,
        spec: SandboxSpec | None = None,
        config: PoolConfig | None = None,
        pool: SandboxPool | None = None,
    ) -> None:
        self._spec, self._config = spec, config
        self._pool = pool
        self._owned = pool is None
        self._lock = asyncio.Lock()

    @property
    def started(self) -> bool:
        return self._pool is not None

    async def pool(self) -> SandboxPool:
        async with self._lock:
            if self._pool is None:
                from tether.sandbox.pool import SandboxPool

                pool = SandboxPool(self._spec, self._config)
                await pool.start()
                self._pool = pool
            return self._pool

    async def aclose(self) -> None:
        async with self._lock:
            if self._pool is not None and self._owned:
                await self._pool.close()
                self._pool = None

    async def __aenter__(self) -> SandboxProvider:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class ScoringContext:
    """Per-episode access to the sandbox, with the time spent in it accumulated for reporting."""

    def __init__(self, sandbox: SandboxProvider | None = None, clock: Callable[[], float] = time.monotonic):
        self.sandbox = sandbox
        self.sandbox_time_s = 0.0
        self._clock = clock

    def child(self) -> ScoringContext:
        """Same sandbox, own timer: one per episode when episodes run concurrently."""
        return ScoringContext(self.sandbox, self._clock)

    async def pool(self) -> SandboxPool:
        if self.sandbox is None:
            raise EnvError("this environment executes code but the scoring context has no sandbox")
        return await self.sandbox.pool()

    async def timed(self, work: Awaitable[T]) -> T:
        """Await sandbox work, adding its time to this context's `sandbox_time_s`."""
        start = self._clock()
        try:
            return await work
        finally:
            self.sandbox_time_s += self._clock() - start

    async def run(self, code: str | bytes, language: str = "python", **kwargs: Any) -> RunResult:
        """`SandboxPool.run` (same keyword arguments), timed."""
        pool = await self.pool()
        return await self.timed(pool.run(code, language=language, **kwargs))

    async def open_session(self, spec: SandboxSpec | None = None) -> SandboxSession:
        pool = await self.pool()
        return await self.timed(pool.open_session(spec))
