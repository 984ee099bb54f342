"""The agents pages of the console."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from tether.console.pages import render
from tether.console.state import Console


def router(console: Console) -> APIRouter:
    routes = APIRouter()

    @routes.get("/agents", response_class=HTMLResponse)
    async def agents_page(request: Request) -> HTMLResponse:
        return render(console.jinja, request, "agents.html", active="agents")

    return routes
