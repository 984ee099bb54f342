"""Where scoring and episodes reach the sandbox: one lazily started sandbox, and a timer per episode.

Pure-Python domains never touch it; domains that execute code (tests, graders, tools) go through a
`ScoringContext`, so nothing a model wrote ever runs in this process and the time spent in the sandbox
is reported per episode. A run or session the sandbox itself fails raises `InfraError`, so that every
domain's infrastructure failures stay out of its rewards without code of its own. The sandbox is
whichever `[sandbox]` configures (`open_sandbox`): a local pool, or a fleet of `tether sandbox serve`
instances, in which case no sandbox worker starts in this process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tether.envs.errors import EnvError
from tether.errors import InfraError, InfraReason, TetherError
from tether.tools.workspace import sound

if TYPE_CHECKING:
    from tether.sandbox.fleet import FleetConfig
    from tether.sandbox.interface import Sandbox, Session
    from tether.sandbox.pool_config import PoolConfig
    from tether.sandbox.result import RunResult
    from tether.sandbox.spec import SandboxSpec

T = TypeVar("T")


class SandboxProvider:
    """One `Sandbox` shared by many scorings and episodes, started on first use and closed once: a local
    pool with `config`, or the fleet `fleet` names (then `config` is unused)."""

    def __init__(
        self,
        spec: SandboxSpec | None = None,
        config: PoolConfig | None = None,
        pool: Sandbox | None = None,
        fleet: FleetConfig | None = None,
    ) -> None:
        self._spec, self._config, self._fleet = spec, config, fleet
        self._pool = pool
        self._owned = pool is None
        self._lock = asyncio.Lock()

    @property
    def started(self) -> bool:
        return self._pool is not None

    async def pool(self) -> Sandbox:
        async with self._lock:
            if self._pool is None:
                from tether.sandbox.factory import open_sandbox

                pool = open_sandbox(self._spec, self._config, self._fleet)
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
    """Per-episode access to the sandbox, with the time spent in it accumulated for reporting (wall time
    waited, `sandbox_time_s`, and the CPU time its runs used, `sandbox_cpu_s` from `RunResult.cpu_ms`), and
    the counters reward components keep of what scoring spent (judge requests, tokens, dollars), which a
    context shares with its children so that a rollout source reads one total per step; what scoring
    opened on its way (a judge's client) is closed with the context (`on_close`, `aclose`)."""

    def __init__(
        self,
        sandbox: SandboxProvider | None = None,
        clock: Callable[[], float] = time.monotonic,
        counters: dict[str, float] | None = None,
        closers: list[Callable[[], Awaitable[None]]] | None = None,
    ):
        self.sandbox = sandbox
        self.sandbox_time_s = 0.0
        self.sandbox_cpu_s = 0.0
        self._clock = clock
        self._counters: dict[str, float] = {} if counters is None else counters
        self._closers: list[Callable[[], Awaitable[None]]] = [] if closers is None else closers

    def child(self) -> ScoringContext:
        """Same sandbox, counters and closers, own timer: one per episode when episodes run concurrently."""
        return ScoringContext(self.sandbox, self._clock, self._counters, self._closers)

    def on_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Have `aclose` await `closer` (once, however often it is registered)."""
        if closer not in self._closers:
            self._closers.append(closer)

    async def aclose(self) -> None:
        """Close what scoring opened (`on_close`), then the sandbox."""
        closers, self._closers[:] = list(self._closers), []
        try:
            for closer in closers:
                await closer()
        finally:
            if self.sandbox is not None:
                await self.sandbox.aclose()

    def count(self, name: str, amount: float = 1.0) -> None:
        """Add `amount` to the counter `name` (a metric key such as `judge/requests`)."""
        self._counters[name] = self._counters.get(name, 0.0) + amount

    def take_counters(self) -> dict[str, float]:
        """The counters summed since the last call, then zeroed (a step's share of them)."""
        taken = dict(self._counters)
        self._counters.clear()
        return taken

    async def pool(self) -> Sandbox:
        if self.sandbox is None:
            raise EnvError("this environment executes code but the scoring context has no sandbox")
        return await self.sandbox.pool()

    async def timed(self, work: Awaitable[T]) -> T:
        """Await sandbox work, adding its time to this context's `sandbox_time_s` and, when it is a run
        (a session's runs come through here too), its CPU time to `sandbox_cpu_s`."""
        from tether.sandbox.result import RunResult

        start = self._clock()
        try:
            result = await work
        finally:
            self.sandbox_time_s += self._clock() - start
        if isinstance(result, RunResult):
            self.sandbox_cpu_s += result.cpu_ms / 1000
        return result

    async def run(self, code: str | bytes, language: str = "python", **kwargs: Any) -> RunResult:
        """`Sandbox.run` (same keyword arguments), timed; a run the sandbox failed raises `InfraError`
        (`sound`): a sandbox error or a failed worker quality check is not the model's doing."""
        pool = await self.pool()
        return sound(await self._sandbox_call(pool.run(code, language=language, **kwargs)))

    async def open_session(self, spec: SandboxSpec | None = None) -> Session:
        """A session of the sandbox, timed; one the sandbox cannot open raises `InfraError`."""
        pool = await self.pool()
        return await self._sandbox_call(pool.open_session(spec))

    async def _sandbox_call(self, work: Awaitable[T]) -> T:
        try:
            return await self.timed(work)
        except InfraError:
            raise
        except (TetherError, OSError) as failure:  # no free slot, a lost instance, a dead worker...
            raise InfraError(InfraReason.SANDBOX_ERROR, f"{type(failure).__name__}: {failure}") from failure
