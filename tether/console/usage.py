"""The usage pages of the console: per tenant and tier the requests, tokens, spend over time, 429s by limit
and time to first token, read from the gateway's ledger (`usage_view.py`); the keys pages (`api_keys.py`) over
the same stores, opened once here. Also the sign-in check of a console beyond loopback: admin keys."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse

from tether.console import api_keys
from tether.console.access import AdminCheck
from tether.console.errors import bad_input, not_configured, not_found
from tether.console.pages import render
from tether.console.state import Console
from tether.console.usage_view import UsageView, read_usage
from tether.errors import ConfigError
from tether.gateway.config import GatewayConfig
from tether.gateway.keys import KeyStore, check_tenant
from tether.gateway.ledger import Ledger
from tether.gateway.runtime import open_stores
from tether.web import AsciiJSONResponse

Days = Annotated[int, Query(ge=1, le=366, description="The window: the last this many days.")]
DAY_CHOICES = (1, 7, 30, 90)


class GatewayStores:
    """The gateway's keys and ledger (one engine), or a refusal naming the flag when none was given."""

    def __init__(self, console: Console) -> None:
        self._stores: tuple[KeyStore, Ledger] | None = None
        if console.config.gateway is not None:
            self._stores = open_stores(console.config.gateway)
            console.on_close(self._stores[0].engine.dispose)

    def get(self) -> tuple[KeyStore, Ledger]:
        if self._stores is None:
            raise not_configured("the gateway's keys and ledger", "--gateway-config or --ledger-url")
        return self._stores


def _tenant_view(stores: GatewayStores, tenant: str, days: int) -> UsageView:
    try:
        check_tenant(tenant)
    except ConfigError as error:
        raise bad_input(str(error), "tenant") from None
    key_store, ledger = stores.get()
    view = read_usage(key_store, ledger, days, tenant)
    if tenant not in view.tenants:
        raise not_found("tenant", tenant, "the usage page lists the tenants with keys or usage")
    return view


def router(console: Console) -> APIRouter:
    routes = APIRouter()
    stores = GatewayStores(console)

    @routes.get("/usage", response_class=HTMLResponse)
    def usage_page(request: Request, days: Days = 7) -> HTMLResponse:
        view = read_usage(*stores.get(), days)
        return render(
            console.jinja, request, "usage.html", active="usage", view=view, days=days, choices=DAY_CHOICES
        )

    @routes.get("/api/usage")
    def usage_json(days: Days = 7) -> AsciiJSONResponse:
        return AsciiJSONResponse(read_usage(*stores.get(), days).as_json())

    @routes.get("/usage/{tenant}", response_class=HTMLResponse)
    def tenant_page(request: Request, tenant: str, days: Days = 30) -> HTMLResponse:
        view = _tenant_view(stores, tenant, days)
        report = stores.get()[1].report(tenant, view.since)  # by day, model and tier, as `gateway usage`
        return render(
            console.jinja,
            request,
            "usage_tenant.html",
            active="usage",
            view=view,
            tenant=tenant,
            report=report,
            days=days,
            choices=DAY_CHOICES,
            tiers=api_keys.TIERS,
            keys=view.keys,
        )

    @routes.get("/api/usage/{tenant}")
    def tenant_json(tenant: str, days: Days = 30) -> AsciiJSONResponse:
        return AsciiJSONResponse(_tenant_view(stores, tenant, days).as_json())

    routes.include_router(api_keys.router(console, stores.get))
    return routes


def admin_check(gateway: GatewayConfig) -> AdminCheck:
    """Whether a token is one of the gateway's admin keys (not revoked), looked up at every request so that
    a key revoked with `tether gateway keys revoke` signs nobody in from then on."""
    key_store, _ = open_stores(gateway)
    return key_store.is_admin
