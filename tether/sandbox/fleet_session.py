"""`FleetSession`: a session on one instance of a sandbox fleet, every call sent to that instance.

The server's session id names its instance (`NAME~s<hex>`). A session's calls are never retried on
another instance: its working directory exists on that one only. When the instance is gone (connection
refused or reset, or 404 "no such session" from an instance that restarted) the call raises
`SessionLost` at once, and the session is over; closing it then is a no-op. An instance that stops
answering costs at most the call's timeout: a run's own limits plus `RUN_MARGIN_S`, a file transfer
`FILES_TIMEOUT_S`.
Calls are serialised, as on a local session.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
from pydantic import ValidationError

from tether.errors import ConfigError, TetherError
from tether.sandbox.interface import SessionLost
from tether.sandbox.result import RunResult
from tether.sandbox.session import SessionClosed
from tether.sandbox.spec import SandboxSpec
from tether.sandbox.wire import encode_files, error_of, run_body

CLOSE_TIMEOUT_S = 10.0  # a close to an instance that stopped answering gives up after this
FILES_TIMEOUT_S = 60.0  # an upload or download
RUN_MARGIN_S = 30.0  # a run may take its own limits plus this before its instance counts as gone
CONNECT_TIMEOUT_S = 5.0


class FleetSession:
    def __init__(
        self,
        http: httpx.AsyncClient,
        instance: str,
        session_id: str,
        spec: SandboxSpec,
        release: Callable[[], None],
        lost: Callable[[], None],
    ) -> None:
        self.id = session_id
        self.instance = instance
        self.spec = spec
        self._http = http
        self._release = release
        self._on_lost = lost
        self._ended: str | None = None  # why the session is over, once it is
        self._lock = asyncio.Lock()

    @property
    def closed(self) -> bool:
        return self._ended is not None

    async def _call(self, method: str, path: str, timeout_s: float, **kwargs: Any) -> httpx.Response:
        async with self._lock:
            if self._ended is not None:
                raise SessionClosed(f"session {self.id} is {self._ended}")
            url = f"{self.instance}/v1/sessions/{self.id}{path}"
            timeout = httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S)
            try:
                response = await self._http.request(method, url, timeout=timeout, **kwargs)
            except httpx.TransportError as error:
                raise self._lose(f"{type(error).__name__}: {error}") from None
            if response.status_code == 404 and error_of(response)[1] == "session_not_found":
                raise self._lose("it does not know the session (restarted?)")
            if response.status_code >= 400:
                message, kind = error_of(response)
                if response.status_code == 404 and kind == "file_not_found":
                    raise FileNotFoundError(message)
                if response.status_code < 500:
                    raise ConfigError(f"sandbox server {self.instance} refused the call: {message}")
                raise TetherError(
                    f"session {self.id} on {self.instance}: HTTP {response.status_code}: {message}"
                )
            return response

    def _lose(self, reason: str) -> SessionLost:
        self._end("lost")
        self._on_lost()
        return SessionLost(self.id, self.instance, reason)

    def _end(self, why: str) -> None:
        if self._ended is None:
            self._ended = why
            self._release()

    async def run(
        self,
        code: str | bytes,
        language: str = "python",
        stdin: str | bytes = "",
        files: Mapping[str, str | bytes] | None = None,
        collect: Sequence[str] = (),
        spec: SandboxSpec | None = None,
    ) -> RunResult:
        body = run_body(code, language, stdin, files or {}, collect, spec)
        limits = spec or self.spec
        timeout_s = limits.timeout_s + limits.compile_timeout_s + RUN_MARGIN_S
        response = await self._call("POST", "/run", timeout_s, json=body)
        try:
            return RunResult.model_validate_json(response.content)
        except ValidationError as error:
            raise TetherError(
                f"session {self.id} on {self.instance}: malformed run result "
                f"({error.error_count()} problem(s))"
            ) from None

    async def upload(self, files: Mapping[str, str | bytes]) -> None:
        await self._call("PUT", "/files", FILES_TIMEOUT_S, json={"files": encode_files(files)})

    async def download(self, paths: Sequence[str]) -> dict[str, bytes]:
        """The files' bytes; a missing one raises FileNotFoundError (the server's message names it)."""
        params = [("path", path) for path in paths]
        response = await self._call("GET", "/files", FILES_TIMEOUT_S, params=params)
        try:
            files = response.json()["files"]
            return {name: base64.b64decode(data, validate=True) for name, data in files.items()}
        except (ValueError, KeyError, TypeError, AttributeError, binascii.Error):
            raise TetherError(f"session {self.id} on {self.instance}: malformed download answer") from None

    async def close(self) -> None:
        """End the session on its instance; an instance that is gone has nothing left to close."""
        async with self._lock:
            if self._ended is not None:
                return
            try:
                url = f"{self.instance}/v1/sessions/{self.id}"
                await self._http.delete(url, timeout=CLOSE_TIMEOUT_S)
            except httpx.TransportError:
                pass  # the instance is gone, and the session with it
            finally:  # also when cancelled: this client's count of the instance's load stays exact
                self._end("closed")

    async def __aenter__(self) -> FleetSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
