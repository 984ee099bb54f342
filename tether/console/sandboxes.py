"""The sandboxes page: each configured `tether sandbox serve` with its slots, run rate, latency, QC
failures, discarded workers and recent failures, refreshed by htmx polling a fragment every `poll_s`.

The page, its fragment and `/api/sandboxes` all read `SandboxWatch.statuses()`; a server that does not
answer shows as down on the page, it does not fail it."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from tether.console.errors import not_configured
from tether.console.pages import render
from tether.console.sandbox_status import SandboxStatus, SandboxWatch
from tether.console.state import Console
from tether.sandbox.failures import RecentFailure


@dataclass(frozen=True, slots=True)
class FleetView:
    """The servers, and their recent failures merged newest first, each with the instance it ran on."""

    servers: list[SandboxStatus]
    failures: list[tuple[str, RecentFailure]]

    @classmethod
    def of(cls, servers: list[SandboxStatus]) -> FleetView:
        failures = [(server.instance, failure) for server in servers for failure in server.failures]
        failures.sort(key=lambda pair: pair[1].at, reverse=True)
        return cls(servers, failures)

    @property
    def up(self) -> int:
        return sum(server.up for server in self.servers)

    def total(self, attribute: str) -> float:
        return float(sum(getattr(server.figures, attribute) for server in self.servers if server.figures))

    @property
    def runs_per_s(self) -> float | None:
        rates = [server.runs_per_s for server in self.servers if server.runs_per_s is not None]
        return sum(rates) if rates else None


def router(console: Console) -> APIRouter:
    routes = APIRouter()
    client = httpx.AsyncClient()
    console.on_close(client.aclose)
    watch = SandboxWatch(console.config.sandbox_urls, client)

    async def fleet() -> FleetView:
        if not watch.urls:
            raise not_configured("no sandbox server", "--sandbox-url URL (a `tether sandbox serve`)")
        return FleetView.of(await watch.statuses())

    def page(request: Request, name: str, view: FleetView) -> HTMLResponse:
        poll_s = max(console.config.poll_s, 1.0)
        return render(console.jinja, request, name, active="sandboxes", fleet=view, poll_s=poll_s)

    @routes.get("/sandboxes", response_class=HTMLResponse)
    async def sandboxes_page(request: Request) -> HTMLResponse:
        return page(request, "sandboxes.html", await fleet())

    @routes.get("/sandboxes/panel", response_class=HTMLResponse)
    async def sandboxes_panel(request: Request) -> HTMLResponse:
        return page(request, "sandboxes_panel.html", await fleet())

    @routes.get("/api/sandboxes")
    async def sandboxes_api() -> dict[str, object]:
        view = await fleet()
        return {"sandboxes": [server.summary() for server in view.servers]}

    return routes
