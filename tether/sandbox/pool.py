"""`SandboxPool`: a warm pool of isolated workers behind a fair queue, with a quality check per run.

    async with SandboxPool(SandboxSpec(timeout_s=5)) as pool:
        result = await pool.run("print(1)", language="python")

Each slot is one worker (see `zygote.py`). The workers start in parallel and `start` returns once the
first is up: each slot opens as its worker comes up, so a first run never waits for the last worker
(`warmed` waits for them all). A run takes a slot, gets empty cgroups from the host, runs, and is
checked: a worker whose fingerprint changed, or whose run left a process behind, is discarded and
replaced, never reused. The pool knows nothing of HTTP; `server.py` puts it on the network.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import time
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from tether.errors import TetherError
from tether.sandbox import protocol
from tether.sandbox.cgroups import (
    CgroupLayout,
    CgroupLimits,
    RunCgroup,
    check_layout,
    prepare_layout,
    remove_stale_groups,
    system_layout,
)
from tether.sandbox.fair_queue import FairQueue
from tether.sandbox.languages import Language, default_languages, lookup
from tether.sandbox.launch import Launch
from tether.sandbox.pool_config import DEVICE_NODES
from tether.sandbox.pool_config import PoolConfig as PoolConfig  # re-exported: its historical home
from tether.sandbox.protocol import RunReply, RunRequest, WorkerInit
from tether.sandbox.qc import QualityReport, quality_check
from tether.sandbox.result import RunResult, RunStatus, assemble
from tether.sandbox.run_request import build_run_request
from tether.sandbox.seccomp import compile_bpf
from tether.sandbox.session import SandboxSession, SessionClosed
from tether.sandbox.spec import SandboxSpec, sandbox_path
from tether.sandbox.worker import IdMap, Worker, WorkerError, remove_stale_skeletons

logger = logging.getLogger(__name__)

_GRACE_S = 10.0


class SandboxUnavailable(RuntimeError):
    """The kernel lacks an isolation primitive and the pool was not started with insecure=True."""


class NoFreeSlot(TetherError):
    """No slot for the request: none freed up within a session's wait, or the queue of runs is at its
    bound (`PoolConfig.max_queued`); `retry_after_s` is when to try again."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SandboxPool:
    def __init__(
        self,
        spec: SandboxSpec | None = None,
        config: PoolConfig | None = None,
        languages: Mapping[str, Language] | None = None,
        launches: Sequence[Launch] = (),
    ) -> None:
        """`launches`: worker processes the caller started ahead (`tether.sandbox.launch`), which the first
        workers take instead of starting their own; one of another interpreter is discarded."""
        self.spec = spec or SandboxSpec()
        self.config = config or PoolConfig()
        self.languages = dict(languages or default_languages(self.config.python_executable))
        self.layout: CgroupLayout | None = None
        self._queue = FairQueue(self.config.slots, free=0)  # each slot opens once its worker is up
        self._warming = self.config.slots  # slots whose first worker is still starting
        self._first_starts: list[asyncio.Task[None]] = []
        self._up = False  # `start` returned: a first worker that fails to start is retried from now
        self._idle: list[Worker] = []
        self._spares: list[Worker] = []  # started, holding no slot: `config.warm_target` of them
        # Every worker started and not yet discarded, wherever it is (idle, in a run or a session, or held
        # by a caller that was cancelled), so that closing the pool stops each one.
        self._workers: set[Worker] = set()
        self._cgroups: list[RunCgroup] = []  # empty run groups recycled by the quality check, for reuse
        self._names = itertools.count()
        self._run_ids = itertools.count()
        self._group_ids = itertools.count()
        self._token = uuid.uuid4().hex[:8]  # keeps run cgroup names apart between pools of one process
        self._init: WorkerInit | None = None
        self._launches = list(launches)
        self._closing = False
        self._background: set[asyncio.Task[None]] = set()
        self.status_counts: dict[RunStatus, int] = dict.fromkeys(RunStatus, 0)
        self.qc_failures = 0
        self.workers_replaced = 0
        self.worker_starts = 0  # workers started after the pool's start
        self.cold_starts = 0  # slots a queued run had to wait on a worker start for
        self.sessions_refused = 0
        self.sessions: dict[str, SandboxSession] = {}

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def queue_depth(self) -> int:
        return self._queue.depth

    @property
    def warm_workers(self) -> int:
        """Started workers ready for a run now: idle ones holding a free slot, and the spares."""
        return len(self._idle) + len(self._spares)

    @property
    def busy_slots(self) -> int:
        return self.config.slots - self._queue.free_slots - self._warming

    def describe_slots(self) -> str:
        """Who holds the slots, for messages: `2 of 2 slots held by open sessions, 0 by runs`."""
        sessions = len(self.sessions)
        return (
            f"{sessions} of {self.config.slots} slots held by open sessions, "
            f"{self.busy_slots - sessions} by runs, {self.queue_depth} runs waiting"
        )

    async def start(self) -> None:
        try:
            await self._start()
        finally:
            # Each first worker takes its launch as its start begins, before the first one is up: what
            # is left now (the start failed, or there were more launches than workers) is of no use.
            self._discard_launches()

    def _discard_launches(self) -> None:
        for launched in self._launches:
            launched.discard()
        self._launches = []

    async def _start(self) -> None:
        self.layout, problem = system_layout(), ""
        if self.layout is None:
            problem = "no usable cgroup hierarchy with memory, pids and cpu controllers"
        else:
            try:
                prepare_layout(self.layout)
                check_layout(self.layout, f"{os.getpid()}-{self._token}-check")
                remove_stale_groups(self.layout)
            except OSError as error:
                where = ", ".join(map(str, self.layout.directories))
                problem = f"the cgroup hierarchy cannot hold per-run groups under {where} ({error})"
                self.layout = None
        if problem:
            if not self.config.insecure:
                raise SandboxUnavailable(
                    f"{problem} (see `tether sandbox doctor`); pass insecure=True / --insecure to run "
                    "without per-run cgroups"
                )
            logger.warning("sandbox pool runs without per-run cgroups: %s", problem)
        remove_stale_skeletons()
        try:
            bpf = compile_bpf()
        except Exception as error:
            if not self.config.insecure:
                raise SandboxUnavailable(f"seccomp is unavailable: {error}") from error
            bpf = b""
        self._init = WorkerInit(
            readonly_paths=self.config.readonly_paths(),
            device_nodes=list(DEVICE_NODES),
            preload_modules=list(self.config.preload_modules),
            seccomp_bpf_b64=protocol.b64encode(bpf),
            run_uid=self.config.run_uid,
            run_gid=self.config.run_uid,
            workdir=self.config.workdir,
            skeleton_dir="",
        )
        count = self.config.slots + self.config.warm_target
        starts = [asyncio.ensure_future(self._first_start(i < self.config.slots)) for i in range(count)]
        self._first_starts = starts
        for task in starts:  # from now: closing the pool, even during this start, cancels them
            self._track(task)
        done, _ = await asyncio.wait(starts, return_when=asyncio.FIRST_COMPLETED)
        failure = next((failed for task in done if (failed := task.exception()) is not None), None)
        if failure is not None:  # a worker that cannot start here says so now, not at the first run
            for task in starts:
                task.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
            await asyncio.gather(*(w.kill() for w in self._workers))
            self._workers, self._idle, self._spares = set(), [], []
            raise SandboxUnavailable(f"sandbox workers failed to start: {failure}") from failure
        self._up = True
        self._spawn(self._expire_sessions())

    async def warmed(self) -> None:
        """Wait until the first worker of every slot and spare is up (a run never needs to)."""
        await asyncio.gather(*self._first_starts)

    async def _first_start(self, into_slot: bool) -> None:
        """Start one of the pool's first workers. Once the pool is up (`start` returned), a failure is
        retried as a replacement would be; before, it is the pool's start that failed."""
        try:
            worker = await self._new_worker()
        except (TimeoutError, WorkerError, OSError):
            if not self._up:
                raise
            await self._start_into(into_slot)
        else:
            (self._idle if into_slot else self._spares).append(worker)
        if into_slot:
            self._warming -= 1
            self._queue.release()

    async def _new_worker(self) -> Worker:
        assert self._init is not None
        worker = Worker(
            f"w{next(self._names)}",
            self._init,
            IdMap(self.config.host_uid_base, self.config.run_uid),
            self.config.python_executable,
        )
        self._workers.add(worker)
        await worker.start(self.config.worker_start_timeout_s, self._take_launch())
        return worker

    def _take_launch(self) -> Launch | None:
        """A worker process launched ahead for this pool's interpreter, discarding any other."""
        while self._launches:
            launched = self._launches.pop()
            if launched.python_executable == self.config.python_executable:
                return launched
            launched.discard()
        return None

    async def close(self) -> None:
        self._closing = True
        for session in list(self.sessions.values()):
            await session.close()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        workers, self._idle, self._workers = {*self._idle, *self._spares, *self._workers}, [], set()
        self._spares = []
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
        for group in self._cgroups:
            group.remove()
        self._cgroups = []

    def build_request(
        self,
        code: str | bytes,
        language: str,
        stdin: str | bytes,
        files: Mapping[str, str | bytes],
        spec: SandboxSpec,
        warm: bool = True,
        dir_id: str | None = None,
        keep_dir: bool = False,
    ) -> tuple[RunRequest, bool]:
        """The worker request for one run (see `run_request.py`) and whether it compiles first."""
        lang = lookup(self.languages, language)
        run_id = dir_id or f"r{next(self._run_ids)}"
        request = build_run_request(
            lang, self.config.workdir, run_id, code, stdin, files, spec, warm, keep_dir
        )
        return request, lang.compile_argv is not None

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
    ) -> RunResult:
        """Run one program in a fresh isolated environment and return its classified result."""
        spec = spec or self.spec
        request, compiled = self.build_request(code, language, stdin, files or {}, spec, warm)
        request.collect = [sandbox_path(path, "collect", self.config.workdir) for path in collect]
        bound = self.config.max_queued
        # A slot still warming up takes a waiting run as soon as its worker is up: it is not a full queue.
        if bound is not None and self._queue.free_slots == 0 and self._queue.depth >= bound + self._warming:
            raise NoFreeSlot(
                f"the run queue is full ({self.queue_depth} of max_queued={bound} waiting; "
                f"{self.describe_slots()}); retry later",
                retry_after_s=1,
            )
        await self._queue.acquire(client)
        worker = self._idle.pop()
        keep = False
        try:
            result, keep = await self.execute(worker, request, spec, compiled)
        finally:
            self._give_back(worker, keep)
        return result

    async def open_session(self, spec: SandboxSpec | None = None, client: str = "") -> SandboxSession:
        """A sandbox whose working directory persists across runs; it holds one slot until closed.

        Waits up to `config.session_wait_s` for a free slot, then raises NoFreeSlot: sessions hold their
        slots until closed or idle, so an unbounded wait could last as long as the longest session.
        """
        wait_s = self.config.session_wait_s
        try:
            async with asyncio.timeout(wait_s):
                await self._queue.acquire(client)
        except TimeoutError:
            self.sessions_refused += 1
            raise NoFreeSlot(
                f"no sandbox slot freed up within {wait_s:g} s: {self.describe_slots()}; "
                "close a session or retry later",
                retry_after_s=max(1, math.ceil(wait_s)),
            ) from None
        session = SandboxSession(self, self._idle.pop(), spec or self.spec)
        self.sessions[session.id] = session
        return session

    def get_session(self, session_id: str) -> SandboxSession:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise SessionClosed(f"no open session {session_id!r}") from None

    def end_session(self, session: SandboxSession, worker: Worker, healthy: bool) -> None:
        self.sessions.pop(session.id, None)
        self._give_back(worker, healthy and worker.alive)

    async def _expire_sessions(self) -> None:
        while True:
            await asyncio.sleep(min(self.config.session_idle_timeout_s / 4, 5.0))
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if now - session.last_used > self.config.session_idle_timeout_s:
                    await session.close()

    async def execute(
        self, worker: Worker, request: RunRequest, spec: SandboxSpec, compiled: bool
    ) -> tuple[RunResult, bool]:
        """Run a built request on a worker this caller holds; returns the result and whether to keep it."""
        try:
            cgroups = self._make_cgroups(request, spec)
        except OSError as failure:
            self.status_counts[RunStatus.SANDBOX_ERROR] += 1
            message = f"cannot create the run's cgroups: {failure}"
            return RunResult(status=RunStatus.SANDBOX_ERROR, error=message), True
        fds = [fd for group in cgroups for fd in group.procs_fds()]  # the groups' own: not closed here
        for step in request.steps:
            step.cgroup_fd_count = len(cgroups[0].directories) if cgroups else 0
        deadline = sum(step.timeout_s for step in request.steps) + _GRACE_S
        reply: RunReply | None = None
        error: str | None = None
        try:
            async with asyncio.timeout(deadline):
                reply = await worker.run(request, fds)
        except (WorkerError, EOFError, OSError, ValueError) as failure:
            error = f"worker {worker.name} failed: {failure}"
        except TimeoutError:
            error = f"worker {worker.name} did not answer within {deadline:.0f} s"
        except asyncio.CancelledError:
            await worker.kill()
            for group in cgroups:
                group.remove()
            raise
        if reply is None:
            await worker.kill()
        stats = [group.stats() for group in cgroups]
        report = quality_check(worker, reply, cgroups)
        self._cgroups.extend(report.recycled)
        result = assemble(reply, stats, compiled, error)
        result.qc, result.qc_detail, result.worker = report.status, report.reasons, worker.name
        self.status_counts[result.status] += 1
        keep = report.passed and worker.alive and worker.runs_served < self.config.max_runs_per_worker
        if not report.passed:
            self.qc_failures += 1
        return result, keep

    def _make_cgroups(self, request: RunRequest, spec: SandboxSpec) -> list[RunCgroup]:
        if self.layout is None:
            return []
        limits = CgroupLimits(spec.memory_mib * 1024 * 1024, spec.pids_max, spec.cpu_limit)
        groups: list[RunCgroup] = []
        try:
            for _ in request.steps:
                if self._cgroups:
                    group = self._cgroups.pop()
                    groups.append(group)
                    group.apply(limits)
                    continue
                group = RunCgroup(self.layout, f"{os.getpid()}-{self._token}-g{next(self._group_ids)}")
                groups.append(group)
                group.create(limits)
        except OSError:
            for group in groups:
                group.remove()
            raise
        return groups

    def _give_back(self, worker: Worker, keep: bool) -> None:
        if keep:
            self._idle.append(worker)
            self._queue.release()
        elif self._spares:  # a warm spare takes the slot at once; a new spare starts meanwhile
            self._idle.append(self._spares.pop())
            self._queue.release()
            self._spawn(self._replace(worker, into_slot=False))
        else:
            self._spawn(self._replace(worker, into_slot=True))

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        self._track(asyncio.ensure_future(coroutine))

    def _track(self, task: asyncio.Task[None]) -> None:
        """Keep a background task until it ends, so that closing the pool cancels it."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _replace(self, worker: Worker, into_slot: bool) -> None:
        """Discard a worker and start a fresh one: into its slot, which is handed out again only then
        (a run waiting meanwhile counts as a cold start), or (`into_slot=False`) as a spare."""
        await worker.kill()
        self._workers.discard(worker)
        self.workers_replaced += 1
        if await self._start_into(into_slot):
            self.worker_starts += 1
        if into_slot:
            if self._queue.depth:
                self.cold_starts += 1
            self._queue.release()

    async def _start_into(self, into_slot: bool) -> bool:
        """Start a worker into the idle list (`into_slot`) or the spares, retrying with backoff until
        one starts (True) or the pool closes (False)."""
        delay = 0.1
        while not self._closing:
            try:
                fresh = await self._new_worker()
                (self._idle if into_slot else self._spares).append(fresh)
                return True
            except (TimeoutError, WorkerError, OSError):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        return False

    async def health(self) -> QualityReport:
        """Run a trivial program through the pool and report whether it came back clean."""
        result = await self.run("print('ok')", language="python")
        return QualityReport(
            result.status is RunStatus.OK and result.stdout == "ok\n" and result.qc.value == "passed",
            result.qc_detail,
        )
