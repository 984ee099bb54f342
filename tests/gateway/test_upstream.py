"""The gateway's HTTP/1.1 client against scripted servers on real sockets: body framing (length, chunked,
until close), keep-alive reuse and its limits, and every failure surfacing as `UpstreamError`."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from tether.gateway.upstream import HttpUpstream, Target, UpstreamError

Answer = Callable[[int], Awaitable[bytes | None]]
"""Request number -> the raw bytes to answer (None: answer nothing and keep the connection open)."""


@dataclass
class Script:
    url: str
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)


@asynccontextmanager
async def scripted(answer: Answer, close_after: bool = False) -> AsyncIterator[Script]:
    """A server that reads whole requests and writes `answer`'s bytes; `close_after` closes each
    connection once its first answer is written."""
    script = Script("")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        script.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                script.requests.append(head + await reader.readexactly(length))
                reply = await answer(len(script.requests))
                if reply is None:
                    await asyncio.sleep(3600)
                    return
                writer.write(reply)
                await writer.drain()
                if close_after:
                    return
        except asyncio.IncompleteReadError:
            return
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    script.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
    try:
        yield script
    finally:
        server.close()


def fixed(reply: bytes) -> Answer:
    async def answer(_: int) -> bytes:
        return reply

    return answer


LENGTH = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'


async def test_requests_reuse_one_connection_and_arrive_whole() -> None:
    upstream = HttpUpstream(timeout_s=5)
    async with scripted(fixed(LENGTH)) as server:
        target = Target.parse(server.url)
        for _ in range(3):
            response = await upstream.post(target, b'{"a":1}')
            assert response.status_code == 200 and await response.aread() == b'{"ok":true}'
        assert server.connections == 1
        port = server.url.split(":")[2].split("/")[0]
        assert (
            server.requests[0]
            == (
                f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                'Content-Type: application/json\r\nContent-Length: 7\r\n\r\n{"a":1}'
            ).encode()
        )
    await upstream.aclose()


async def test_chunked_bodies_are_relayed_chunk_by_chunk() -> None:
    reply = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"6\r\ndata: \r\n3;ext=1\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n"
    )
    upstream = HttpUpstream(timeout_s=5)
    async with scripted(fixed(reply)) as server:
        target = Target.parse(server.url)
        response = await upstream.post(target, b"{}")
        assert [chunk async for chunk in response.aiter_bytes()] == [b"data: ", b"abc"]
        response = await upstream.post(target, b"{}")
        assert await response.aread() == b"data: abc"
        assert server.connections == 1
    await upstream.aclose()


@pytest.mark.parametrize(
    ("reply", "server_closes"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end", True),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 13\r\n\r\nuntil the end", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 13\r\n\r\nuntil the end", False),
    ],
    ids=["no-length", "connection-close", "http-1.0"],
)
async def test_connections_that_end_with_the_body_are_not_reused(reply: bytes, server_closes: bool) -> None:
    upstream = HttpUpstream(timeout_s=5)
    async with scripted(fixed(reply), close_after=server_closes) as server:
        target = Target.parse(server.url)
        for _ in range(2):
            response = await upstream.post(target, b"{}")
            assert await response.aread() == b"until the end"
        assert server.connections == 2
    await upstream.aclose()


async def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    upstream = HttpUpstream(timeout_s=5)
    async with scripted(fixed(LENGTH), close_after=True) as server:
        target = Target.parse(server.url)
        for _ in range(3):
            response = await upstream.post(target, b"{}")
            assert await response.aread() == b'{"ok":true}'
            await asyncio.sleep(0.05)  # the server's close reaches the idle connection
        assert server.connections == 3
    await upstream.aclose()


async def test_a_response_closed_before_its_body_closes_the_connection() -> None:
    upstream = HttpUpstream(timeout_s=5)
    async with scripted(fixed(LENGTH)) as server:
        target = Target.parse(server.url)
        response = await upstream.post(target, b"{}")
        await response.aclose()
        response = await upstream.post(target, b"{}")
        assert await response.aread() == b'{"ok":true}'
        assert server.connections == 2
    await upstream.aclose()


async def test_interim_answers_are_skipped() -> None:
    upstream = HttpUpstream(timeout_s=5)
    async with scripted(fixed(b"HTTP/1.1 100 Continue\r\n\r\n" + LENGTH)) as server:
        response = await upstream.post(Target.parse(server.url), b"{}")
        assert response.status_code == 200 and await response.aread() == b'{"ok":true}'
    await upstream.aclose()


async def silent(_: int) -> None:
    return None


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (silent, "no answer within 0.2 s"),
        (fixed(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"), "did not answer in HTTP/1.1"),
        (fixed(b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n"), "bad Content-Length"),
        (fixed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"), "chunk size line"),
        (fixed(b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n"), "bad Content-Length"),
        (fixed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n"), "chunk size line"),
        (fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nshort"), "closed the connection"),
        (fixed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n50\r\nshort"), "closed the connection"),
        (fixed(b"HTTP/1.1 200 OK\r\n"), "closed the connection"),
    ],
    ids=[
        "timeout",
        "not-http",
        "bad-length",
        "bad-chunk",
        "negative-length",
        "negative-chunk",
        "truncated",
        "truncated-chunk",
        "truncated-head",
    ],
)
async def test_broken_answers_are_upstream_errors(answer: Answer, message: str) -> None:
    upstream = HttpUpstream(timeout_s=0.2)
    async with scripted(answer, close_after=True) as server:
        with pytest.raises(UpstreamError, match=re.escape(message)):
            response = await upstream.post(Target.parse(server.url), b"{}")
            await response.aread()
    await upstream.aclose()


async def test_an_unreachable_upstream_is_an_upstream_error() -> None:
    upstream = HttpUpstream(timeout_s=1)
    with pytest.raises(UpstreamError, match=re.escape("cannot connect to http://127.0.0.1:9")):
        await upstream.post(Target.parse("http://127.0.0.1:9/v1/completions"), b"{}")


@pytest.mark.parametrize("url", ["ftp://host/x", "http:///nohost", "localhost:8000"])
def test_targets_must_be_http_urls_with_a_host(url: str) -> None:
    with pytest.raises(ValueError, match="expected an http"):
        Target.parse(url)
