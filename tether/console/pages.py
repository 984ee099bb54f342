"""Rendering: the Jinja2 templates every page extends, and the few filters they share."""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from starlette.responses import Response

from tether.console.errors import ConsoleError
from tether.web import AsciiJSONResponse

HERE = Path(__file__).parent
STATIC = HERE / "static"
NAV = (
    ("runs", "/runs", "Runs"),
    ("agents", "/agents", "Agents"),
    ("sandboxes", "/sandboxes", "Sandboxes"),
    ("usage", "/usage", "Usage"),
    ("jobs", "/jobs", "Jobs"),
    ("playground", "/playground", "Playground"),
)


def _when(at: float | None) -> str:
    if at is None:
        return "-"
    return dt.datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M:%S")


def _num(value: object, digits: int = 3) -> str:
    """A figure for a table cell: integers as they are, floats to `digits` significant digits, '-' if none."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.{digits}g}"


def templates() -> Jinja2Templates:
    found = Jinja2Templates(directory=HERE / "templates")
    found.env.filters["when"] = _when
    found.env.filters["num"] = _num
    found.env.globals["nav"] = NAV
    return found


def root_of(request: Request) -> str:
    """Where the console is mounted ('' at the top; '/console' inside the gateway): every link a page
    writes starts with it (`{{ root }}/runs`)."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def local_path(request: Request) -> str:
    """The request's path below the console's mount point."""
    return request.url.path.removeprefix(root_of(request)) or "/"


def render(
    jinja: Jinja2Templates, request: Request, name: str, status_code: int = 200, **context: Any
) -> HTMLResponse:
    return jinja.TemplateResponse(
        request, name, {"root": root_of(request), **context}, status_code=status_code
    )


def wants_json(request: Request) -> bool:
    path = local_path(request)
    return path.startswith("/api/") or path == "/api"


def error_response(request: Request, error: ConsoleError) -> Response:
    """`/api/...`: 4xx JSON. An htmx action: a fragment shown in the page's flash area. A page: a page that
    says what went wrong and how to go on, with the same status."""
    if wants_json(request):
        return AsciiJSONResponse(error.body(), status_code=error.status)
    jinja: Jinja2Templates = request.app.state.jinja
    if "hx-request" in request.headers:
        response = render(jinja, request, "flash.html", status_code=error.status, error=error)
        response.headers["HX-Retarget"] = "#flash"
        response.headers["HX-Reswap"] = "innerHTML"
        return response
    return render(jinja, request, "error.html", status_code=error.status, error=error, active="")
