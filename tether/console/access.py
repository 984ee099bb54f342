"""Who may use the console, checked on the server for every request.

On loopback (the default) anyone on this machine may; on any other address every request needs an admin
token of the gateway (`Authorization: Bearer ...`, or the cookie `/login` sets). Either way a request that
changes something (any method but GET/HEAD) must come from the console's own pages: it carries htmx's
`HX-Request` header or an `Authorization` header, and an `Origin`, if sent, that is this console's. A
cross-site form cannot set either header, so another site open in the same browser cannot cancel a task.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import Request
from starlette.responses import Response

from tether.console.errors import ConsoleError
from tether.console.pages import error_response, local_path

AdminCheck = Callable[[str], bool]
COOKIE = "tether_console_token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
OPEN_PATHS = ("/login", "/static/console.css", "/healthz")


@dataclass(frozen=True, slots=True)
class Access:
    require_admin: bool
    admin_check: AdminCheck | None

    def token(self, request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            return header[7:].strip() or None
        return request.cookies.get(COOKIE) or None

    def refusal(self, request: Request) -> ConsoleError | None:
        """Why this request may not go on, or None if it may."""
        if self.require_admin and not local_path(request).startswith(OPEN_PATHS):
            token = self.token(request)
            if token is None:
                return ConsoleError(
                    401, "this console needs an admin token: sign in at /login", "unauthorized"
                )
            if self.admin_check is None or not self.admin_check(token):
                return ConsoleError(403, "this token is not a gateway admin key (or is revoked)", "forbidden")
        if request.method not in SAFE_METHODS:
            origin = request.headers.get("origin")
            if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
                return ConsoleError(
                    403, f"a request from {origin} may not act on this console", "cross_origin"
                )
            if "hx-request" not in request.headers and "authorization" not in request.headers:
                return ConsoleError(
                    403, "actions come from the console's pages (HX-Request) or carry a token", "not_console"
                )
        return None

    async def middleware(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        refusal = self.refusal(request)
        if refusal is not None:
            return error_response(request, refusal)
        return await call_next(request)
