"""The usage pages of the console."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from tether.console.access import AdminCheck
from tether.console.pages import render
from tether.console.state import Console
from tether.errors import ConfigError
from tether.gateway.config import GatewayConfig


def router(console: Console) -> APIRouter:
    routes = APIRouter()

    @routes.get("/usage", response_class=HTMLResponse)
    async def usage_page(request: Request) -> HTMLResponse:
        return render(console.jinja, request, "usage.html", active="usage")

    return routes


def admin_check(gateway: GatewayConfig) -> AdminCheck:
    """Whether a token is one of the gateway's admin keys (not revoked)."""
    raise ConfigError("gateway admin keys are not built yet")
