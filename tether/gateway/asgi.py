"""Bare ASGI plumbing for the completion routes, which skip FastAPI: the message types, reading a request's
body and its `Authorization` header, and a whole JSON answer sent as two messages. No gateway logic."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

_JSON_TYPE = (b"content-type", b"application/json")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected before its request body arrived: there is no one to answer."""


async def read_body(receive: Receive) -> bytes:
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    parts = [body]
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        parts.append(message.get("body", b""))
    return b"".join(parts)


def authorization(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return str(value.decode("latin-1"))
    return None


@dataclass(frozen=True, slots=True)
class WholeJson:
    """A complete JSON answer, sent as two ASGI messages without building a framework response."""

    status_code: int
    content: bytes
    headers: list[tuple[bytes, bytes]]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-length", b"%d" % len(self.content)), _JSON_TYPE, *self.headers]
        await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": self.content})
