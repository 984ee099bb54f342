"""The gateway's configuration: upstream engine pools, tiers, prices, default limits, the admission
queue and where the ledger and shared limits live. One pydantic model, validated on load.

Nothing here does I/O except `load_gateway_config`, which reads one TOML or JSON file.
"""

from __future__ import annotations

import json
import tomllib
from decimal import Decimal
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tether.chat.pricing import DEFAULT_PRICES, Price, Tier
from tether.config import state_home
from tether.errors import ConfigError, describe_validation_error


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(_Strict):
    """Limits of one key or one tenant; None means unlimited. Windows slide."""

    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_window: int | None = Field(None, ge=1)
    token_window_s: float = Field(600.0, gt=0)
    budget_usd: Decimal | None = Field(None, gt=0)
    budget_period_s: float = Field(30 * 86400.0, gt=0)


def parse_usd(text: str, label: str) -> Decimal:
    """An amount of USD as a user typed it (`--budget-usd`, a form's field named `label`)."""
    try:
        return Decimal(text.strip())
    except ArithmeticError:
        raise ConfigError(f"{label} {text!r}: expected a decimal number of USD, like 25.50") from None


def key_limits(
    requests_per_minute: int | None = None,
    tokens_per_window: int | None = None,
    token_window_s: float = 600.0,
    budget_usd: Decimal | None = None,
    budget_period_s: float = 30 * 86400.0,
) -> Limits:
    """A key's limits from what `tether gateway keys create` and the console's key form take; a
    ConfigError naming each bad value and what is accepted."""
    try:
        return Limits(
            requests_per_minute=requests_per_minute,
            tokens_per_window=tokens_per_window,
            token_window_s=token_window_s,
            budget_usd=budget_usd,
            budget_period_s=budget_period_s,
        )
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, "key limits")) from None


class Routing(StrEnum):
    """How a pool picks the replica for a request (`gateway/routing.py`)."""

    PREFIX = "prefix"
    """Consistent hashing with bounded load on the request's prefix key; least-loaded when it has none."""
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


class Pool(_Strict):
    """Engine replicas serving the same models. Each request goes to one healthy replica chosen by
    `routing`; one whose connection fails or that answers 5xx before anything reached the client is
    retried on another, up to `max_attempts` replicas."""

    urls: list[str] = Field(min_length=1)
    max_in_flight: int = Field(64, ge=1)
    """Requests sent to this pool at once; more wait in the admission queue."""
    max_queued: int = Field(256, ge=0)
    """Requests waiting for the pool; more are refused with 503."""
    queue_deadline_s: float = Field(30.0, gt=0)
    """Longest wait in the queue before a 503."""
    send_priority: bool = True
    """Send the tier's `priority` extension (tether's engine honours it; strict OpenAI servers may not)."""
    routing: Routing = Routing.PREFIX
    tokenizer: str | None = None
    """A model folder with the engines' tokenizer and chat template: prefix keys are then the engine's own
    block hashes of the rendered prompt. Without it a key hashes the prompt's leading text."""
    block_size: int = Field(16, ge=1)
    """The engines' KV block size in tokens (`tether serve` uses 16)."""
    route_prefix_tokens: int = Field(256, ge=1)
    """Tokens of the prompt's start that make its prefix key: requests sharing them share a replica."""
    load_factor: float = Field(2.0, ge=1.0, le=100.0)
    """Bounded load's c: no replica takes a request while it runs more than c times the average. An engine
    batches the requests it runs, and a request sent away from its prefix pays a whole prefill, so the
    default tolerates more imbalance than web balancers do (HAProxy's 1.25)."""
    virtual_nodes: int = Field(64, ge=1, le=4096)
    """Points per replica on the hash ring."""
    health_path: str | None = "/healthz"
    """GET on each replica every `health_interval_s`; None turns health checks off."""
    health_interval_s: float = Field(1.0, gt=0)
    health_timeout_s: float = Field(2.0, gt=0)
    unhealthy_after: int = Field(2, ge=1)
    """Consecutive failures (checks or refused connections) that take a replica out; one success brings
    it back."""
    max_attempts: int = Field(3, ge=1)
    """Replicas one request may be sent to before its failure is the client's answer."""

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")) or url.rstrip("/").count("/") != 2:
                raise ValueError(
                    f"{url!r}: expected an engine's base URL like http://10.0.0.1:8000 (no path)"
                )
        seen = [url.rstrip("/") for url in urls]
        twice = sorted({url for url in seen if seen.count(url) > 1})
        if twice:
            raise ValueError(f"{twice}: each replica once; a URL listed twice is one replica")
        return urls

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_folder(cls, folder: str | None) -> str | None:
        if folder is None:
            return None
        path = Path(folder).expanduser()
        if not path.is_dir():
            raise ValueError(f"{folder!r}: no such folder; expected a model folder holding tokenizer.json")
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise ValueError(f"{folder!r}: no tokenizer.json or tokenizer_config.json in this folder")
        return str(path)

    @model_validator(mode="after")
    def _whole_blocks(self) -> Pool:
        if self.route_prefix_tokens < self.block_size:
            raise ValueError(
                f"route_prefix_tokens = {self.route_prefix_tokens}: expected at least block_size "
                f"({self.block_size}): a key names whole KV blocks"
            )
        return self

    @field_validator("health_path")
    @classmethod
    def _path(cls, path: str | None) -> str | None:
        if path is not None and not path.startswith("/"):
            raise ValueError(f"{path!r}: expected a path starting with / (like /healthz)")
        return path


class StoreDown(StrEnum):
    """What admission does while its shared store cannot be reached."""

    REFUSE = "refuse"
    """503 + Retry-After naming the store: the pools' limits hold, no request gets through."""
    LOCAL = "local"
    """Admit against this instance's own count: each instance may send a pool its max_in_flight."""


class SharedAdmission(_Strict):
    """Admission counted in Redis across gateway instances: each pool's `max_in_flight` holds for all of
    them together. A slot is a lease, renewed while its request runs: an instance that dies holds its
    slots at most `lease_s` longer."""

    url: str
    """Redis, e.g. redis://cache:6379/0 (rediss:// for TLS, unix:///path.sock)."""
    prefix: str = "tether:gw:admission:"
    lease_s: float = 10.0
    """How long a slot outlives its holder's last renewal (renewed every lease_s / 3)."""
    poll_s: float = 0.25
    """How often a waiting instance re-checks without a release notice (a lost notice, an expired lease)."""
    on_store_down: StoreDown = StoreDown.REFUSE

    @field_validator("url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme == "unix" and parts.path:
            return url
        database = parts.path.strip("/")
        try:
            port_ok = parts.port is None or parts.port > 0
        except ValueError:  # not a number, or out of range
            port_ok = False
        if (
            parts.scheme not in ("redis", "rediss")
            or not parts.hostname
            or not port_ok
            or not (database == "" or database.isdigit())
        ):
            raise ValueError(
                f"{url!r}: expected a Redis URL like redis://cache:6379/0 (redis://HOST[:PORT][/DB], "
                "rediss:// for TLS, or unix:///path/to/redis.sock)"
            )
        return url

    @field_validator("lease_s", "poll_s")
    @classmethod
    def _positive(cls, value: float) -> float:
        if not value > 0:
            raise ValueError(f"must be > 0 seconds, got {value}")
        return value

    @model_validator(mode="after")
    def _poll_within_lease(self) -> SharedAdmission:
        # a waiting instance's place in the shared queue is a lease too, renewed at each poll
        if self.poll_s >= self.lease_s / 3:
            raise ValueError(
                f"poll_s = {self.poll_s} must be below lease_s / 3 = {self.lease_s / 3:g}, "
                "or a waiting instance would lose its place between polls"
            )
        return self


class ReservationEstimate(_Strict):
    """How many tokens a request may use, reserved before it runs. With byte-level BPE tokenizers a token
    covers at least one byte, so prompt UTF-8 bytes bound the prompt tokens; the template adds a few."""

    per_request_tokens: int = Field(64, ge=0)
    per_message_tokens: int = Field(8, ge=0)
    default_max_tokens: int = Field(1024, ge=1)
    """Sent upstream as `max_tokens` when the client gives none, so every request's output is bounded."""


DEFAULT_MODEL = "smollm2-135m-instruct"
"""The model `tether serve` serves by default, under this name: the default gateway fronts it."""
DEFAULT_ENGINE_URL = "http://127.0.0.1:8000"
"""Where `tether serve` listens by default."""


class GatewayConfig(_Strict):
    models: dict[str, str] = Field(default_factory=lambda: {DEFAULT_MODEL: "default"})
    """Model name (as clients ask for it) -> pool name."""
    upstream_models: dict[str, str] = Field(default_factory=dict)
    """Model name -> the name its pool's engines serve it under, sent upstream instead; models without an
    entry are sent under their own name."""
    pools: dict[str, Pool] = Field(default_factory=lambda: {"default": Pool(urls=[DEFAULT_ENGINE_URL])})
    fast_pools: dict[str, str] = Field(default_factory=dict)
    """Model name -> pool dedicated to the fast tier (optional)."""
    tier_priority: dict[Tier, int] = Field(default_factory=lambda: {Tier.STANDARD: 0, Tier.FAST: 10})
    """The engine scheduler's `priority` per tier; higher is served first."""
    prices: dict[str, dict[Tier, Price]] = Field(default_factory=dict)
    """Model name -> tier -> price; models without an entry use the defaults."""
    default_key_limits: Limits = Field(default_factory=Limits)
    tenant_limits: dict[str, Limits] = Field(default_factory=dict)
    default_tenant_limits: Limits = Field(default_factory=Limits)
    estimate: ReservationEstimate = Field(default_factory=ReservationEstimate)
    ledger_url: str = Field(default_factory=lambda: f"sqlite:///{state_home() / 'gateway.db'}")
    """Default: `gateway.db` in the state directory ($TETHER_HOME), wherever the command runs."""
    table_prefix: str = "gw_"
    redis_url: str | None = None
    """Shared limits for several gateway instances; None keeps them in this process."""
    redis_prefix: str = "tether:gw:"
    shared_admission: SharedAdmission | None = None
    """Count the pools' `max_in_flight` across gateway instances in Redis; None counts in this process."""
    key_cache_s: float = Field(5.0, ge=0)
    """How long a looked-up key is trusted; a revocation reaches running gateways within this time."""
    upstream_timeout_s: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _check_references(self) -> GatewayConfig:
        for model, pool in {**self.models, **self.fast_pools}.items():
            if pool not in self.pools:
                raise ValueError(f"model {model!r} uses pool {pool!r}; known pools: {sorted(self.pools)}")
        for model in [*self.fast_pools, *self.prices, *self.upstream_models]:
            if model not in self.models:
                raise ValueError(
                    f"model {model!r} is configured but not served; models: {sorted(self.models)}"
                )
        missing = set(Tier) - set(self.tier_priority)
        if missing:
            raise ValueError(f"tier_priority: give every tier a priority; missing {sorted(missing)}")
        if not self.table_prefix.replace("_", "").isalnum():
            raise ValueError(f"table_prefix {self.table_prefix!r}: use letters, digits and underscores only")
        return self

    def price(self, model: str, tier: Tier) -> Price:
        return self.prices.get(model, {}).get(tier) or DEFAULT_PRICES[tier]

    def upstream_model(self, model: str) -> str:
        return self.upstream_models.get(model, model)

    def pool_for(self, model: str, tier: Tier) -> str:
        if tier is Tier.FAST and model in self.fast_pools:
            return self.fast_pools[model]
        return self.models[model]

    def tenant(self, name: str) -> Limits:
        return self.tenant_limits.get(name, self.default_tenant_limits)


def parse_gateway_config(data: dict[str, Any], source: str = "gateway config") -> GatewayConfig:
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, source, GatewayConfig)) from None


def load_gateway_config(path: Path | None) -> GatewayConfig:
    """The file's settings (TOML, or JSON when it ends in .json); the defaults when `path` is None."""
    if path is None:
        return GatewayConfig()
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"gateway config {path}: cannot read it: {error.strerror}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"gateway config {path}: not valid {path.suffix or 'TOML'}: {error}") from None
    return parse_gateway_config(data, str(path))
