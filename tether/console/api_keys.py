"""The gateway's API keys in the console: listed per tenant, created from a form (the secret is shown once,
in the flash area, and never stored) and revoked, through the same `key_limits` and `KeyStore` that
`tether gateway keys create/revoke` use. Admin keys are made only with the CLI (`keys create --admin`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from tether.chat.pricing import Tier
from tether.console.errors import ConsoleError, bad_input, not_found
from tether.console.pages import render
from tether.console.state import Console
from tether.errors import ConfigError, describe_validation_error
from tether.gateway.config import key_limits, parse_usd
from tether.gateway.keys import ApiKey, KeyStore, UnknownKey, check_tenant
from tether.gateway.ledger import Ledger
from tether.web import AsciiJSONResponse

TIERS = tuple(tier.value for tier in Tier)
Stores = Callable[[], tuple[KeyStore, Ledger]]
NO_STORE = {"Cache-Control": "no-store"}  # a secret is shown once: no cache may keep it
TenantQuery = Annotated[str | None, Query(max_length=64, description="Only this tenant's keys.")]


class KeyForm(BaseModel):
    """A new key as the form (or `POST /api/keys`) gives it; blank fields are unset, as in the CLI."""

    model_config = ConfigDict(extra="forbid")
    tenant: str = Field(min_length=1, max_length=64)
    tier: Tier = Tier.STANDARD
    name: str = Field("", max_length=128)
    rpm: int | None = None
    tokens: int | None = None
    token_window_s: float = 600.0
    budget_usd: str | None = Field(None, max_length=64)
    budget_period_s: float = 30 * 86400.0

    @field_validator("rpm", "tokens", "budget_usd", mode="before")
    @classmethod
    def _blank_is_unset(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("token_window_s", "budget_period_s", mode="before")
    @classmethod
    def _blank_is_default(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, str) and not value.strip() and info.field_name is not None:
            return cls.model_fields[info.field_name].default
        return value

    def create(self, store: KeyStore) -> tuple[str, ApiKey]:
        check_tenant(self.tenant)
        budget = None if self.budget_usd is None else parse_usd(self.budget_usd, "budget_usd")
        limits = key_limits(self.rpm, self.tokens, self.token_window_s, budget, self.budget_period_s)
        return store.create(self.tenant, self.tier, limits, self.name)


def _form(fields: dict[str, object]) -> KeyForm:
    try:
        return KeyForm.model_validate(fields)
    except ValidationError as error:
        raise bad_input(describe_validation_error(error, "new key", KeyForm)) from None


def _revoke(store: KeyStore, key_id: str) -> ApiKey:
    try:
        return store.revoke(key_id)
    except UnknownKey:
        raise not_found("key", key_id, "the keys page lists every key") from None
    except ConfigError as error:  # already revoked: the state conflicts, the id is fine
        raise ConsoleError(409, str(error), "already_revoked", "key_id") from None


def _listed(store: KeyStore, tenant: str | None) -> list[ApiKey]:
    if tenant:
        try:
            check_tenant(tenant)
        except ConfigError as error:
            raise bad_input(str(error), "tenant") from None
    return store.list(tenant or None)


def router(console: Console, stores: Stores) -> APIRouter:
    routes = APIRouter()
    changed = {"HX-Trigger": "keys-changed"}  # the keys table on the page reloads itself

    @routes.get("/keys", response_class=HTMLResponse)
    def keys_page(request: Request, tenant: TenantQuery = None) -> HTMLResponse:
        listed = _listed(stores()[0], tenant)
        return render(
            console.jinja,
            request,
            "usage_keys.html",
            active="usage",
            keys=listed,
            tenant=tenant or "",
            tiers=TIERS,
        )

    @routes.get("/keys/table", response_class=HTMLResponse)
    def keys_table(request: Request, tenant: TenantQuery = None) -> HTMLResponse:
        listed = _listed(stores()[0], tenant)
        return render(console.jinja, request, "usage_keys_table.html", keys=listed, tenant=tenant or "")

    @routes.get("/api/keys")
    def keys_json(tenant: TenantQuery = None) -> AsciiJSONResponse:
        return AsciiJSONResponse([key.summary() for key in _listed(stores()[0], tenant)])

    @routes.post("/keys", response_class=HTMLResponse)
    async def create_from_form(request: Request) -> HTMLResponse:
        form = _form(dict(await request.form()))
        secret, record = form.create(stores()[0])
        response = render(console.jinja, request, "usage_flash.html", created=record, secret=secret)
        response.headers.update({**changed, **NO_STORE})
        return response

    @routes.post("/api/keys", status_code=201)
    def create_from_json(form: KeyForm) -> AsciiJSONResponse:
        secret, record = form.create(stores()[0])
        return AsciiJSONResponse({"key": secret, **record.summary()}, status_code=201, headers=NO_STORE)

    @routes.post("/keys/{key_id}/revoke", response_class=HTMLResponse)
    def revoke_from_page(request: Request, key_id: str) -> HTMLResponse:
        record = _revoke(stores()[0], key_id)
        response = render(console.jinja, request, "usage_flash.html", revoked=record)
        response.headers.update(changed)
        return response

    @routes.post("/api/keys/{key_id}/revoke")
    def revoke_from_api(key_id: str) -> AsciiJSONResponse:
        return AsciiJSONResponse(_revoke(stores()[0], key_id).summary())

    return routes
