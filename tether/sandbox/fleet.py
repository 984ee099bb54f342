"""`SandboxFleet`: the `Sandbox` interface over HTTP, spread across `tether sandbox serve` instances.

    async with SandboxFleet(spec, FleetConfig(endpoints=("http://sandbox-0:8080", ...))) as fleet:
        result = await fleet.run("print(1)", language="python")
        async with await fleet.open_session() as session:   # pinned to the instance that opened it
            await session.run("echo hi > a.txt", "bash")

Dispatch is `balancer.py`'s: least-loaded by each instance's `GET /v1/load` (polled every
`load_interval_s`) plus this client's own in-flight count. A run is idempotent (a fresh sandbox, no
effects outside it), so a connection failure, timeout, malformed answer or 5xx sends it to another
instance, at most `max_attempts` failures. Back-pressure is not failure: a 503 + Retry-After (the
server's bounded queue is full, or it has no slot for a session) backs that instance off, and when
every instance is full the run waits here, in a bounded line (`max_waiting`, `wait_timeout_s`). A 4xx
is the caller's mistake, raised as `ConfigError` and never retried. Sessions (`fleet_session.py`) are
never retried elsewhere: their working directory exists on one instance only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import TypeAdapter, ValidationError

from tether.errors import ConfigError, TetherError
from tether.sandbox.balancer import Balancer, Instance, Load, Verdict
from tether.sandbox.discovery import DiscoveryFailed, DnsDiscovery, Resolver
from tether.sandbox.fleet_session import FleetSession
from tether.sandbox.result import RunResult
from tether.sandbox.spec import SandboxSpec
from tether.sandbox.wire import error_of, is_back_pressure, retry_after_s, run_body

log = logging.getLogger("tether.sandbox.fleet")
_LOAD = TypeAdapter(Load)


class FleetUnavailable(TetherError):
    """No instance answered: every attempt failed with a connection error, timeout or 5xx."""


class FleetBusy(TetherError):
    """Every instance stayed full: too many requests already wait here, or the wait ran out."""


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """Where the fleet is and how the client treats it. Exactly one of `endpoints` and `discovery`."""

    endpoints: tuple[str, ...] = ()  # base URLs, http(s)://HOST:PORT
    discovery: str | None = None  # dns+http://NAME:PORT, re-resolved every `discovery_interval_s`
    max_attempts: int = 3  # failed instances per run (or session open) before FleetUnavailable
    cooldown_s: float = 10.0  # a failed instance is skipped this long, unless a load poll finds it up
    request_timeout_s: float = 600.0  # one request: must cover queueing, compiling and running
    connect_timeout_s: float = 5.0
    load_interval_s: float = 1.0  # how often each instance's GET /v1/load is polled
    discovery_interval_s: float = 5.0
    max_waiting: int = 4096  # requests waiting here for capacity before FleetBusy
    wait_timeout_s: float = 600.0  # the longest a request waits for capacity
    max_connections: int = 1024

    def __post_init__(self) -> None:
        if bool(self.endpoints) == (self.discovery is not None):
            raise ConfigError("a sandbox fleet needs exactly one of endpoints (base URLs) or discovery")
        for url in self.endpoints:
            normalize_endpoint(url)
        if self.discovery is not None:
            DnsDiscovery.parse(self.discovery)
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts = {self.max_attempts!r}: must be at least 1")
        if self.cooldown_s < 0:
            raise ConfigError(f"cooldown_s = {self.cooldown_s!r}: must not be negative")
        if self.max_waiting < 0:
            raise ConfigError(f"max_waiting = {self.max_waiting!r}: must not be negative")
        for name in (
            "request_timeout_s",
            "connect_timeout_s",
            "load_interval_s",
            "discovery_interval_s",
            "wait_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} = {getattr(self, name)!r}: must be positive")


def normalize_endpoint(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"sandbox endpoint {url!r}: must be an http:// or https:// URL with a host")
    return url.rstrip("/")


class SandboxFleet:
    """A client of a fleet of sandbox servers; `spec` is sent with every run that passes none."""

    def __init__(
        self,
        spec: SandboxSpec | None,
        config: FleetConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        resolver: Resolver = socket.getaddrinfo,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._spec = spec or SandboxSpec()
        self.config = config
        self.discovery = (
            DnsDiscovery.parse(config.discovery, resolver) if config.discovery is not None else None
        )
        urls = [normalize_endpoint(url) for url in config.endpoints]
        self.balancer = Balancer(urls, config.cooldown_s, clock)
        # No pool timeout: waiting for one of our own connections says nothing about a server's health.
        timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s, pool=None)
        limits = httpx.Limits(
            max_connections=config.max_connections, max_keepalive_connections=config.max_connections
        )
        self.http = httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport)
        self._changed = asyncio.Event()
        self._waiting = 0
        self._poller: asyncio.Task[None] | None = None

    @property
    def spec(self) -> SandboxSpec:
        return self._spec

    async def __aenter__(self) -> SandboxFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Resolve the fleet (discovery), read every instance's load once, then keep both fresh."""
        if self.discovery is not None:
            self.balancer.set_members(await self.discovery.resolve())
        await self.refresh_load()
        self._poller = asyncio.create_task(self._poll())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        await self.http.aclose()

    # ---- background: load and membership ----------------------------------------------------------

    async def refresh_load(self) -> None:
        await asyncio.gather(*(self._read_load(i) for i in list(self.balancer.instances)))
        self._notify()

    async def _read_load(self, instance: Instance) -> None:
        timeout = min(self.config.connect_timeout_s, self.config.load_interval_s * 2)
        try:
            response = await self.http.get(f"{instance.url}/v1/load", timeout=timeout)
            response.raise_for_status()
            load = _LOAD.validate_json(response.content)
        except httpx.TransportError as error:
            if self.balancer.up(instance):
                log.warning("sandbox instance %s is not answering: %s", instance.url, error)
            self.balancer.failed(instance)
            return
        except (httpx.HTTPStatusError, ValidationError) as error:
            # It answers, but reports no load: it is dispatched by this client's in-flight count alone.
            log.debug("sandbox instance %s reports no load: %s", instance.url, error)
            return
        self.balancer.report(instance, load)

    async def _poll(self) -> None:
        next_discovery = time.monotonic() + self.config.discovery_interval_s
        while True:
            await asyncio.sleep(self.config.load_interval_s)
            if self.discovery is not None and time.monotonic() >= next_discovery:
                next_discovery = time.monotonic() + self.config.discovery_interval_s
                try:
                    self.balancer.set_members(await self.discovery.resolve())
                except DiscoveryFailed as error:  # keep the last known fleet
                    log.warning("%s; keeping %d known instance(s)", error, len(self.balancer.instances))
            try:
                await self.refresh_load()
            except Exception:  # the poller must outlive any one bad answer, or loads go stale
                log.exception("reading the sandbox fleet's load failed")

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- dispatch ----------------------------------------------------------------------------------

    async def _acquire(self, tried: set[str], deadline: float, failures: list[str]) -> Instance:
        """The next instance for one attempt, waiting (bounded) while the whole fleet is full."""
        while True:
            choice = self.balancer.choose(tried)
            if choice.verdict is Verdict.PICKED:
                assert choice.instance is not None
                self.balancer.begin(choice.instance)
                return choice.instance
            if choice.verdict is Verdict.EXHAUSTED:
                raise FleetUnavailable(
                    f"no sandbox server answered after {len(failures)} attempt(s): {'; '.join(failures)}"
                    if failures
                    else "the sandbox fleet has no instance"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FleetBusy(
                    f"every sandbox instance stayed full for {self.config.wait_timeout_s:g} s "
                    f"({self.describe()})"
                )
            if self._waiting >= self.config.max_waiting:
                raise FleetBusy(
                    f"every sandbox instance is full and {self._waiting} requests already wait "
                    f"(max_waiting={self.config.max_waiting}; {self.describe()})"
                )
            wait_s = min(remaining, self.config.load_interval_s, choice.wait_s or math.inf)
            self._waiting += 1
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), max(wait_s, 0.01))
            finally:
                self._waiting -= 1

    def _release(self, instance: Instance) -> None:
        self.balancer.end(instance)
        self._notify()

    def describe(self) -> str:
        parts = []
        for i in self.balancer.instances:
            slots = i.load.slots if i.load else "?"
            state = "" if self.balancer.up(i) else ", down"
            parts.append(f"{i.url}: {i.estimate()}/{slots} in use{state}")
        return "; ".join(parts) or "no instance"

    async def _dispatch(self, path: str, body: dict[str, Any]) -> tuple[Instance, httpx.Response]:
        """POST `body` to instances until one answers (<500, not back-pressure); the instance is held
        (`begin`) for the caller, which releases it. A 4xx is raised as ConfigError."""
        deadline = time.monotonic() + self.config.wait_timeout_s
        tried: set[str] = set()
        failures: list[str] = []
        while True:
            instance = await self._acquire(tried, deadline, failures)
            try:
                response = await self.http.post(f"{instance.url}{path}", json=body)
            except httpx.TransportError as error:
                failure = f"{type(error).__name__}: {error}"
            except BaseException:
                self._release(instance)
                raise
            else:
                if is_back_pressure(response):
                    self.balancer.refused(instance, retry_after_s(response))
                    self._release(instance)
                    continue
                if response.status_code < 500:
                    self.balancer.succeeded(instance)
                    if response.status_code >= 400:
                        self._release(instance)
                        raise ConfigError(
                            f"sandbox server {instance.url} refused the request: {error_of(response)[0]}"
                        )
                    return instance, response
                failure = f"HTTP {response.status_code}: {error_of(response)[0]}"
            self.balancer.failed(instance)
            self._release(instance)
            tried.add(instance.url)
            failures.append(f"{instance.url}: {failure}")
            if len(failures) >= self.config.max_attempts:
                raise FleetUnavailable(
                    f"no sandbox server answered after {len(failures)} attempt(s): {'; '.join(failures)}"
                )

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
        """Run one program on the least-loaded instance, elsewhere if that one fails."""
        body = run_body(code, language, stdin, files or {}, collect, spec or self._spec)
        body.update(warm=warm, client=client)
        attempts = 0
        while True:
            instance, response = await self._dispatch("/v1/run", body)
            self._release(instance)
            try:
                return RunResult.model_validate_json(response.content)
            except ValidationError as error:  # a proxy's page, a truncated body: that instance failed
                self.balancer.failed(instance)
                attempts += 1
                if attempts >= self.config.max_attempts:
                    raise FleetUnavailable(
                        f"{instance.url} answered the run with a malformed result "
                        f"({error.error_count()} problem(s)) after {attempts} attempt(s)"
                    ) from None

    async def open_session(self, spec: SandboxSpec | None = None, client: str = "") -> FleetSession:
        """A session on the least-loaded instance; every later call goes to that instance only.

        Opening is retried elsewhere like a run (a failed open created nothing the caller knows of; a
        session a server created but never reported expires there when idle)."""
        del client  # sessions are not fair-queued on the server: each holds one slot while open
        spec = spec or self._spec
        instance, response = await self._dispatch("/v1/sessions", {"spec": spec.model_dump(mode="json")})
        try:
            session_id = str(response.json()["id"])
        except (ValueError, KeyError, TypeError):
            self._release(instance)
            self.balancer.failed(instance)
            raise FleetUnavailable(
                f"{instance.url} answered the session open without an id: {response.text[:200]!r}"
            ) from None
        return FleetSession(
            self.http,
            instance.url,
            session_id,
            spec,
            release=lambda: self._release(instance),
            lost=lambda: self.balancer.failed(instance),
        )
