"""The console's ASGI app: its pages and `/api/...` routes over the stores in `ConsoleConfig`.

Each page module (`runs`, `agents`, `sandboxes`, `usage`, `jobs`, `playground`) gives a router built from
the `Console` below; stores are opened when the app starts and closed when it stops. Every error a route
raises becomes a `ConsoleError` answer (JSON under `/api`, a page elsewhere), never a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from tether.console import agents, jobs, login, playground, runs, sandboxes, usage
from tether.console.access import Access, AdminCheck
from tether.console.config import ConsoleConfig
from tether.console.errors import ConsoleError, bad_input
from tether.console.pages import STATIC, error_response, local_path, root_of, templates
from tether.console.state import Console
from tether.errors import ConfigError, TetherError

log = logging.getLogger(__name__)


def _describe_validation(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(part) for part in item.get("loc", ()) if part not in ("body", "query", "path"))
        parts.append(f"{where or 'input'}: {item.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid input"


def create_app(config: ConsoleConfig, admin_check: AdminCheck | None = None) -> FastAPI:
    if config.require_admin and admin_check is None:
        raise ConfigError(
            f"a console on {config.host} (not loopback) needs the gateway's admin keys to check sign-ins: "
            "give it --gateway-config or --ledger-url"
        )
    console = Console(config, templates())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            for closer in reversed(console.closers):
                result = closer()
                if hasattr(result, "__await__"):
                    await result

    app = FastAPI(
        title="tether console", lifespan=lifespan, docs_url="/api/docs", openapi_url="/api/openapi.json"
    )
    app.state.jinja = console.jinja
    app.state.console = console
    app.state.admin_check = admin_check
    access = Access(config.require_admin, admin_check)
    app.middleware("http")(access.middleware)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.exception_handler(ConsoleError)
    async def console_error(request: Request, error: ConsoleError) -> Response:
        return error_response(request, error)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> Response:
        return error_response(request, bad_input(_describe_validation(error)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        if error.status_code == 404:
            path = local_path(request)
            return error_response(request, ConsoleError(404, f"{path}: no such page", "unknown_page"))
        return error_response(request, ConsoleError(error.status_code, str(error.detail), "http_error"))

    @app.exception_handler(TetherError)
    async def user_error(request: Request, error: TetherError) -> Response:
        # A store's own refusal (an unknown key id, a bad tenant name, ...): the user's input, so a 4xx.
        return error_response(request, bad_input(str(error)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> Response:
        log.exception("console: %s %s failed", request.method, request.url.path)
        return error_response(
            request,
            ConsoleError(500, f"the console failed on this request ({type(error).__name__})", "internal"),
        )

    @app.get("/", include_in_schema=False)
    async def home(request: Request) -> RedirectResponse:
        return RedirectResponse(f"{root_of(request)}/runs", status_code=303)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    for page in (login, runs, agents, sandboxes, usage, jobs, playground):
        app.include_router(page.router(console))
    return app
