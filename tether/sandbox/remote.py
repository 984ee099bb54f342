"""`RemoteSandboxPool`: `SandboxPool.run` over HTTP, spread across `tether sandbox serve` instances.

    async with RemoteSandboxPool(["http://sandbox-0:8080", "http://sandbox-1:8080"]) as pool:
        result = await pool.run("print(1)", language="python")

Each run goes to the instance with the fewest runs in flight from this client (ties rotate). A
connection failure, timeout, malformed answer or 5xx marks that instance unhealthy for `cooldown_s`
and the run is retried on another one, at most `max_attempts` tries and each instance at most once
per run. Retrying is safe because a run has no effects outside its own fresh sandbox. A 4xx is the
caller's mistake: it is raised as `ConfigError`, never retried. Sessions are not proxied here (a
session lives on one instance); code and stdin must be UTF-8 text on the wire.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import ValidationError

from tether.errors import ConfigError, TetherError
from tether.sandbox.result import RunResult
from tether.sandbox.spec import SandboxSpec


class RemoteUnavailable(TetherError):
    """No instance answered the run: every attempt failed with a connection error, timeout or 5xx."""


@dataclass(slots=True, eq=False)  # compared by identity: each is one live instance's state
class Endpoint:
    url: str
    in_flight: int = 0
    unhealthy_until: float = 0.0
    failures: int = 0


class Balancer:
    """Chooses an instance for each attempt. Pure: no I/O, time comes from `clock`."""

    def __init__(self, urls: Sequence[str], cooldown_s: float, clock: Callable[[], float]) -> None:
        assert urls, "a balancer needs at least one endpoint"
        self.endpoints = [Endpoint(url) for url in urls]
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._next = 0

    def healthy(self, endpoint: Endpoint) -> bool:
        return endpoint.unhealthy_until <= self._clock()

    def pick(self, tried: set[str]) -> Endpoint | None:
        """The least-loaded healthy endpoint not yet tried; if none is healthy, the one recovering first."""
        untried = [e for e in self.endpoints if e.url not in tried]
        if not untried:
            return None
        candidates = [e for e in untried if self.healthy(e)] or [
            min(untried, key=lambda e: e.unhealthy_until)
        ]
        least = min(e.in_flight for e in candidates)
        count = len(self.endpoints)
        for offset in range(count):
            index = (self._next + offset) % count
            endpoint = self.endpoints[index]
            if endpoint in candidates and endpoint.in_flight == least:
                self._next = index + 1
                return endpoint
        raise AssertionError("unreachable: a least-loaded candidate always exists")

    def begin(self, endpoint: Endpoint) -> None:
        endpoint.in_flight += 1

    def end(self, endpoint: Endpoint, ok: bool) -> None:
        endpoint.in_flight -= 1
        if ok:
            endpoint.unhealthy_until = 0.0
        else:
            endpoint.failures += 1
            endpoint.unhealthy_until = self._clock() + self.cooldown_s


def normalize_endpoint(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"sandbox endpoint {url!r}: must be an http:// or https:// URL with a host")
    return url.rstrip("/")


def _text(value: str | bytes, name: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return value.decode()
    except UnicodeDecodeError as error:
        raise ConfigError(f"{name} is not UTF-8 text ({error}); the HTTP API carries it as text") from None


def run_body(
    code: str | bytes,
    language: str,
    stdin: str | bytes,
    files: Mapping[str, str | bytes],
    collect: Sequence[str],
    spec: SandboxSpec | None,
    client: str,
    warm: bool,
) -> dict[str, Any]:
    """The JSON body of `POST /v1/run` (the server's `RunBody`)."""
    encoded = {
        path: base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")
        for path, data in files.items()
    }
    body: dict[str, Any] = {
        "code": _text(code, "code"),
        "language": language,
        "stdin": _text(stdin, "stdin"),
        "files": encoded,
        "collect": list(collect),
        "warm": warm,
        "client": client,
    }
    if spec is not None:
        body["spec"] = spec.model_dump(mode="json")
    return body


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500] or response.reason_phrase


class RemoteSandboxPool:
    """A client of one or more sandbox servers with `SandboxPool`'s `run` signature.

    `spec`, when given, is sent with every run that does not pass its own; otherwise each server
    applies its own spec. `request_timeout_s` must cover queueing, compiling and running on the
    server; a run that outlasts it counts as a failed instance. `transport` replaces the network
    (an `httpx.ASGITransport` or `httpx.MockTransport` in tests).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        spec: SandboxSpec | None = None,
        *,
        max_attempts: int = 3,
        cooldown_s: float = 10.0,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        max_connections: int = 1024,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not endpoints:
            raise ConfigError("RemoteSandboxPool needs at least one endpoint URL")
        if max_attempts < 1:
            raise ConfigError(f"max_attempts = {max_attempts!r}: must be at least 1")
        if cooldown_s < 0:
            raise ConfigError(f"cooldown_s = {cooldown_s!r}: must not be negative")
        self.spec = spec
        self.max_attempts = max_attempts
        self.balancer = Balancer(list(dict.fromkeys(map(normalize_endpoint, endpoints))), cooldown_s, clock)
        # No pool timeout: waiting for one of our own connections says nothing about a server's health.
        timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s, pool=None)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport)

    async def __aenter__(self) -> RemoteSandboxPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

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
        """Run one program on some instance: `ConfigError` on a 4xx, `RemoteUnavailable` if none answer."""
        body = run_body(code, language, stdin, files or {}, collect, spec or self.spec, client, warm)
        tried: set[str] = set()
        failures: list[str] = []
        while len(tried) < self.max_attempts:
            endpoint = self.balancer.pick(tried)
            if endpoint is None:
                break
            tried.add(endpoint.url)
            self.balancer.begin(endpoint)
            failure: str | None = None  # a 4xx or a cancellation says nothing against the instance
            try:
                result, failure = await self._attempt(endpoint.url, body)
            finally:
                self.balancer.end(endpoint, ok=failure is None)
            if result is not None:
                return result
            failures.append(f"{endpoint.url}: {failure}")
        raise RemoteUnavailable(
            f"no sandbox server answered after {len(tried)} attempt(s): {'; '.join(failures)}"
        )

    async def _attempt(self, url: str, body: dict[str, Any]) -> tuple[RunResult | None, str | None]:
        """One request: the result, or why this instance failed. A 4xx raises (the request is wrong)."""
        try:
            response = await self._http.post(f"{url}/v1/run", json=body)
        except httpx.TransportError as error:
            return None, f"{type(error).__name__}: {error}"
        if response.status_code >= 500:
            return None, f"HTTP {response.status_code}: {_error_message(response)}"
        if response.status_code >= 400:
            raise ConfigError(f"sandbox server {url} refused the run: {_error_message(response)}")
        try:
            return RunResult.model_validate_json(response.content), None
        except ValidationError as error:
            return None, f"malformed answer (HTTP {response.status_code}): {error.error_count()} problem(s)"
