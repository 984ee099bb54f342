"""The gateway's HTTP/1.1 client for its engines: keep-alive connections per origin, each request sent in
one write, response bodies framed by Content-Length, chunked encoding or the connection's end, and handed
on as they arrive (a stream is never buffered whole).

It does only what forwarding to an OpenAI-compatible engine needs: POST with a JSON body, and GET for
health checks. No redirects, cookies, proxies, compression (no Accept-Encoding is sent) or HTTP/2. A
general client (httpx) spent more CPU per request than all the rest of the gateway's work, which is why
this one exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

from tether.errors import TetherError

_HEAD_LIMIT = 64 * 1024
_READ_SIZE = 64 * 1024

Origin = tuple[str, str, int]
T = TypeVar("T")


class UpstreamError(TetherError):
    """Connecting, sending or reading failed or timed out, or the upstream broke HTTP/1.1."""


@dataclass(frozen=True, slots=True)
class Target:
    """One upstream endpoint, with the head of every request to it encoded once."""

    url: str
    origin: Origin
    head: bytes
    """Up to the Content-Length value, which follows per request."""

    @classmethod
    def parse(cls, url: str, method: str = "POST") -> Target:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r}: expected an http:// or https:// URL with a host")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.netloc.rpartition("@")[2]
        head = (
            f"{method} {parts.path or '/'} HTTP/1.1\r\nHost: {host}\r\n"
            "Content-Type: application/json\r\nContent-Length: "
        ).encode()
        return cls(url, (parts.scheme, parts.hostname, port), head)


class Response(Protocol):
    status_code: int

    async def aread(self) -> bytes: ...

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class Upstream(Protocol):
    """Where the gateway's requests go: `post` returns once the status and headers are in."""

    async def post(self, target: Target, body: bytes) -> Response: ...

    async def get(self, target: Target) -> Response:
        """`target` parsed with method="GET"."""
        ...

    async def aclose(self) -> None: ...


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @property
    def idle_and_open(self) -> bool:
        """The server has not closed it (an idle keep-alive timeout shows here as end of stream)."""
        return not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        self.writer.close()


class HttpResponse:
    """The status and the body still to read; the connection goes back to the pool once the body is read
    through, and is closed if the response is closed before that."""

    def __init__(
        self,
        upstream: HttpUpstream,
        origin: Origin,
        connection: _Connection,
        status_code: int,
        length: int | None,
        chunked: bool,
        keep_alive: bool,
    ) -> None:
        self.status_code = status_code
        self._upstream, self._origin, self._connection = upstream, origin, connection
        self._length, self._chunked, self._keep_alive = length, chunked, keep_alive
        self._complete = False
        self._closed = False

    async def aread(self) -> bytes:
        if self._length is not None and not self._chunked:
            body = await self._upstream.read(self._connection.reader.readexactly(self._length))
            self._complete = True
            await self.aclose()
            return body
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        try:
            if self._chunked:
                while size := await self._chunk_size():
                    async for piece in self._exactly(size):
                        yield piece
                    if await self._upstream.read(self._connection.reader.readexactly(2)) != b"\r\n":
                        raise UpstreamError("bad chunked encoding: a chunk does not end in CRLF")
                while await self._upstream.read(self._connection.reader.readuntil(b"\r\n")) != b"\r\n":
                    pass  # trailers
            elif self._length is not None:
                async for piece in self._exactly(self._length):
                    yield piece
            else:  # no length: the body ends with the connection
                self._keep_alive = False
                while piece := await self._upstream.read(self._connection.reader.read(_READ_SIZE)):
                    yield piece
            self._complete = True
        finally:
            await self.aclose()

    async def _exactly(self, size: int) -> AsyncIterator[bytes]:
        """`size` bytes as they arrive, in pieces of at most `_READ_SIZE`."""
        while size:
            piece = await self._upstream.read(self._connection.reader.read(min(size, _READ_SIZE)))
            if not piece:
                raise UpstreamError(f"the upstream closed the connection {size} bytes before the body's end")
            size -= len(piece)
            yield piece

    async def _chunk_size(self) -> int:
        line = await self._upstream.read(self._connection.reader.readuntil(b"\r\n"))
        try:
            size = int(line.split(b";", 1)[0], 16)
        except ValueError:
            size = -1
        if size < 0:
            raise UpstreamError(f"bad chunked encoding: chunk size line {line[:40]!r}")
        return size

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._complete and self._keep_alive:
            self._upstream.give_back(self._origin, self._connection)
        else:
            self._connection.close()


class HttpUpstream:
    """Keep-alive HTTP/1.1 to any number of origins. How many requests run at once is the admission
    queue's business; this keeps at most `max_idle` idle connections per origin."""

    def __init__(self, timeout_s: float, connect_timeout_s: float = 10.0, max_idle: int = 64) -> None:
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: dict[Origin, list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    async def post(self, target: Target, body: bytes) -> HttpResponse:
        return await self._request(target, body)

    async def get(self, target: Target) -> HttpResponse:
        assert target.head.startswith(b"GET "), "parse the target with method='GET'"
        return await self._request(target, b"")

    async def _request(self, target: Target, body: bytes) -> HttpResponse:
        connection = self._take(target.origin) or await self._connect(target.origin)
        try:
            connection.writer.write(target.head + b"%d\r\n\r\n" % len(body) + body)
            await self.read(connection.writer.drain())
            return await self._response(target.origin, connection)
        except BaseException:
            connection.close()
            raise

    async def read(self, step: Awaitable[T]) -> T:
        """One wait for the upstream, bounded by `timeout_s`; its failures become `UpstreamError`."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await step
        except TimeoutError:
            raise UpstreamError(f"no answer within {self.timeout_s:g} s (upstream_timeout_s)") from None
        except asyncio.IncompleteReadError:
            raise UpstreamError("the upstream closed the connection before its response ended") from None
        except (asyncio.LimitOverrunError, OSError) as error:
            raise UpstreamError(f"reading from the upstream failed: {error!r}") from None

    def give_back(self, origin: Origin, connection: _Connection) -> None:
        idle = self._idle.setdefault(origin, [])
        if len(idle) < self.max_idle and connection.idle_and_open:
            idle.append(connection)
        else:
            connection.close()

    def _take(self, origin: Origin) -> _Connection | None:
        """The most recently used open connection: the least likely to have hit the server's idle timeout."""
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if connection.idle_and_open:
                return connection
            connection.close()
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        scheme, host, port = origin
        if scheme == "https" and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=self._tls if scheme == "https" else None, limit=_HEAD_LIMIT
                )
        except TimeoutError:
            raise UpstreamError(
                f"cannot connect to {scheme}://{host}:{port} within {self.connect_timeout_s:g} s"
            ) from None
        except OSError as error:
            raise UpstreamError(f"cannot connect to {scheme}://{host}:{port}: {error!r}") from None
        with contextlib.suppress(OSError):  # a request is one write: nothing to gain from Nagle's delay
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Connection(reader, writer)

    async def _response(self, origin: Origin, connection: _Connection) -> HttpResponse:
        while True:
            head = await self.read(connection.reader.readuntil(b"\r\n\r\n"))
            lines = head[:-4].split(b"\r\n")
            version, _, rest = lines[0].partition(b" ")
            try:
                status = int(rest[:3])
            except ValueError:
                status = 0
            if not version.startswith(b"HTTP/1.") or not 100 <= status <= 599:
                raise UpstreamError(f"the upstream did not answer in HTTP/1.1: {lines[0][:80]!r}")
            if status >= 200:
                break  # an interim 1xx answer is followed by the real one
        length: int | None = None
        chunked = False
        keep_alive = version == b"HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = -1
                if length < 0:
                    raise UpstreamError(f"bad Content-Length {value.strip()[:40]!r}")
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                tokens = value.lower()
                keep_alive = b"close" not in tokens and (keep_alive or b"keep-alive" in tokens)
        if status in (204, 304):
            length, chunked = 0, False
        return HttpResponse(self, origin, connection, status, length, chunked, keep_alive)

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()
