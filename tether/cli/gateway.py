"""`tether gateway ...`: serve the API gateway, manage its keys, report usage and benchmark it."""

from __future__ import annotations

import csv
import datetime as dt
import re
import sys
from decimal import Decimal
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from tether.chat.pricing import Tier
from tether.cli.common import CacheDirOption, cache_root, err_console, print_json, user_errors
from tether.errors import ConfigError
from tether.gateway.config import GatewayConfig, load_gateway_config
from tether.machine import warn_if_busy

if TYPE_CHECKING:
    from starlette.types import ASGIApp

app = typer.Typer(help="The API gateway: keys, usage, serving and benchmarks.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys: create, list, revoke.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
console = Console()

ConfigOption = Annotated[
    Path | None,
    typer.Option("--gateway-config", envvar="TETHER_GATEWAY_CONFIG", help="Gateway TOML/JSON config file."),
]
LedgerOption = Annotated[
    str | None,
    typer.Option("--ledger-url", help="sqlite:///PATH or postgresql://... (overrides the config)."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


class LogLevel(StrEnum):
    CRITICAL = "critical"
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"
    DEBUG = "debug"
    TRACE = "trace"


_RELATIVE = re.compile(r"^(\d+)([dhm])$")


def _config(path: Path | None, ledger_url: str | None = None) -> GatewayConfig:
    config = load_gateway_config(path)
    return config.model_copy(update={"ledger_url": ledger_url}) if ledger_url else config


def parse_since(value: str, now: dt.datetime) -> float:
    """`7d`, `24h`, `30m` before `now`, or an ISO date/datetime (UTC unless it names a zone)."""
    relative = _RELATIVE.match(value)
    if relative:
        amount, unit = int(relative.group(1)), relative.group(2)
        delta = {
            "d": dt.timedelta(days=amount),
            "h": dt.timedelta(hours=amount),
            "m": dt.timedelta(minutes=amount),
        }
        return (now - delta[unit]).timestamp()
    try:
        moment = dt.datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(
            f"--since {value!r}: expected a duration like 7d, 24h or 30m, or an ISO date like 2026-11-01"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.timestamp()


@app.callback()
def main() -> None:
    """The API gateway: keys, usage, serving and benchmarks."""


@app.command("serve")
def serve_command(
    config_file: ConfigOption = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=1, max=65535, help="TCP port to listen on (LiteLLM's 4000).")
    ] = 4000,
    log_level: Annotated[
        LogLevel, typer.Option("--log-level", help="uvicorn's log level; debug also logs every request.")
    ] = LogLevel.INFO,
    with_console: Annotated[
        bool,
        typer.Option(
            "--console", help="Also serve the web console at /console (its playground talks to this gateway)."
        ),
    ] = False,
    console_model_key: Annotated[
        str | None,
        typer.Option(
            "--console-model-key",
            envvar="TETHER_CONSOLE_MODEL_KEY",
            help="A gateway key the console's playground sends to this gateway.",
        ),
    ] = None,
) -> None:
    """Serve the gateway until interrupted (by default in front of `tether serve` on its default port)."""
    with user_errors():
        from tether.gateway.runtime import serve_gateway

        config = _config(config_file)
        mounts = console_mounts(config, host, port, console_model_key) if with_console else {}
        if with_console:
            err_console.print(f"tether console: http://{host}:{port}{CONSOLE_PATH}/")
        serve_gateway(config, host, port, log_level.value, mounts=mounts)


CONSOLE_PATH = "/console"


def console_mounts(
    config: GatewayConfig, host: str, port: int, model_api_key: str | None = None
) -> dict[str, ASGIApp]:
    """The console over this gateway's keys and ledger, to mount at `CONSOLE_PATH` (the gateway itself
    cannot import the console). Beyond loopback it signs in with the gateway's admin keys."""
    from tether.console.app import create_app
    from tether.console.config import ConsoleConfig
    from tether.console.usage import admin_check
    from tether.scheduler.store import default_store_path

    loopback = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    console = ConsoleConfig(
        gateway=config,
        jobs_db=default_store_path(),
        model_urls=(f"http://{loopback}:{port}/v1",),
        model_api_key=model_api_key,
        host=host,
    )
    return {CONSOLE_PATH: create_app(console, admin_check(config) if console.require_admin else None)}


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option("--tenant", help="The tenant the key bills to.")],
    tier: Annotated[Tier, typer.Option("--tier", help="Price and priority tier.")] = Tier.STANDARD,
    name: Annotated[str, typer.Option("--name", help="A label for people.")] = "",
    rpm: Annotated[int | None, typer.Option("--rpm", min=1, help="Requests per minute.")] = None,
    tokens: Annotated[int | None, typer.Option("--tokens", min=1, help="Tokens per window.")] = None,
    token_window_s: Annotated[
        float, typer.Option("--token-window-s", min=0.001, help="Token window, in seconds.")
    ] = 600.0,
    budget_usd: Annotated[str | None, typer.Option("--budget-usd", help="Spend per budget period.")] = None,
    budget_period_s: Annotated[
        float, typer.Option("--budget-period-s", min=0.001, help="Budget period, in seconds (30 days).")
    ] = 30 * 86400.0,
    admin: Annotated[
        bool, typer.Option("--admin", help="The key may also sign in to a console beyond loopback.")
    ] = False,
    config_file: ConfigOption = None,
    ledger_url: LedgerOption = None,
    as_json: JsonOption = False,
) -> None:
    """Create a key; its secret is printed once and never stored."""
    from tether.gateway.config import key_limits, parse_usd
    from tether.gateway.runtime import open_stores

    with user_errors():
        budget = None if budget_usd is None else parse_usd(budget_usd, "--budget-usd")
        limits = key_limits(rpm, tokens, token_window_s, budget, budget_period_s)
        keys, _ = open_stores(_config(config_file, ledger_url))
        secret, record = keys.create(tenant, tier, limits, name, admin=admin)
    if as_json:
        print_json(
            {"key": secret, "key_id": record.key_id, "tenant": tenant, "tier": tier.value, "admin": admin}
        )
        return
    kind = "admin key" if admin else "key"
    console.print(
        f"{kind} id {record.key_id} for tenant {tenant} ({tier.value}); the secret, shown only now:"
    )
    sys.stdout.write(secret + "\n")


@keys_app.command("list")
def keys_list(
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's keys.")] = None,
    config_file: ConfigOption = None,
    ledger_url: LedgerOption = None,
    as_json: JsonOption = False,
) -> None:
    """Every key (revoked ones too), oldest first; secrets are never shown."""
    from tether.gateway.runtime import open_stores

    with user_errors():
        keys, _ = open_stores(_config(config_file, ledger_url))
        records = keys.list(tenant)
    rows = [r.summary() for r in records]
    if as_json:
        print_json(rows)
        return
    table = Table(title="gateway keys")
    for column in ("key_id", "tenant", "tier", "name", "admin", "limits", "created", "revoked"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(row[c] if row[c] is not None else "-") for c in row))
    console.print(table)


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key id, from `keys list`.")],
    config_file: ConfigOption = None,
    ledger_url: LedgerOption = None,
) -> None:
    """Revoke a key: running gateways refuse it within their key_cache_s."""
    from tether.gateway.runtime import open_stores

    with user_errors():
        keys, _ = open_stores(_config(config_file, ledger_url))
        record = keys.revoke(key_id)
    console.print(f"revoked key {record.key_id} of tenant {record.tenant}")


@app.command("usage")
def usage_command(
    tenant: Annotated[str, typer.Option("--tenant", help="The tenant to report on.")],
    since: Annotated[str, typer.Option("--since", help="7d, 24h, 30m, or an ISO date/datetime.")] = "30d",
    as_csv: Annotated[bool, typer.Option("--csv", help="Print CSV.")] = False,
    config_file: ConfigOption = None,
    ledger_url: LedgerOption = None,
    as_json: JsonOption = False,
) -> None:
    """Tokens and cost of a tenant by day, model and tier."""
    from tether.gateway.runtime import open_stores

    with user_errors():
        start = parse_since(since, dt.datetime.now(dt.UTC))
        config = _config(config_file, ledger_url)
        _, ledger = open_stores(config)
        report = ledger.report(tenant, start)
    if not report:
        # An empty report from the wrong ledger looks like a quiet tenant: name the ledger that was read.
        err_console.print(
            f"no usage of {tenant} since {dt.datetime.fromtimestamp(start, dt.UTC):%Y-%m-%d %H:%M} UTC "
            f"in the ledger {config.ledger_url}",
            highlight=False,
            soft_wrap=True,
        )
    columns = [
        "day",
        "model",
        "tier",
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "cost_usd",
    ]
    rows = [
        [
            r.day,
            r.model,
            r.tier.value,
            r.requests,
            r.prompt_tokens,
            r.cached_tokens,
            r.completion_tokens,
            str(r.cost_usd),
        ]
        for r in report
    ]
    if as_csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)
        return
    if as_json:
        print_json([dict(zip(columns, row, strict=True)) for row in rows])
        return
    table = Table(
        title=f"usage of {tenant} since {dt.datetime.fromtimestamp(start, dt.UTC):%Y-%m-%d %H:%M} UTC"
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("day", "model", "tier") else "right")
    for row in rows:
        table.add_row(*(str(value) for value in row))
    total = sum((r.cost_usd for r in report), Decimal(0))
    table.caption = f"total {total} USD"
    console.print(table)


@app.command("bench")
def bench_command(
    ctx: typer.Context,
    requests: Annotated[int, typer.Option("--requests", help="Sequential requests per path.")] = 400,
    duration_s: Annotated[float, typer.Option("--duration-s", help="Length of the throughput phase.")] = 5.0,
    concurrency: Annotated[
        int | None,
        typer.Option("--concurrency", min=1, help="Clients at once (throughput phase: 32; --routing: 8)."),
    ] = None,
    warmup: Annotated[int, typer.Option("--warmup", help="Unmeasured requests first.")] = 50,
    as_json: JsonOption = False,
    routing: Annotated[
        bool,
        typer.Option(
            "--routing",
            help="Instead: prefix-aware routing vs round-robin over real `tether serve` replicas, and a "
            "replica killed mid-run.",
        ),
    ] = False,
    model: Annotated[
        str, typer.Option("--model", help="--routing: a registered model or a model folder.")
    ] = "smollm2-135m-instruct",
    prompts: Annotated[int, typer.Option("--prompts", help="--routing: distinct system prompts.")] = 8,
    requests_per_prompt: Annotated[
        int, typer.Option("--requests-per-prompt", help="--routing: requests per system prompt.")
    ] = 50,
    replicas: Annotated[int, typer.Option("--replicas", help="--routing: engine replicas.")] = 3,
    prompt_tokens: Annotated[
        int, typer.Option("--prompt-tokens", help="--routing: tokens per system prompt, at least.")
    ] = 1100,
    cache_dir: CacheDirOption = None,
) -> None:
    """Added latency versus calling the upstream directly (p50, p99) and max requests/s, in one run;
    with --routing, prefix-aware routing against round-robin over engine replicas."""
    with user_errors():
        if routing:
            from tether.gateway.routing_bench import RoutingBenchConfig, run_routing_bench
            from tether.models.loader import resolve

            folder = resolve(model, cache_root(ctx, cache_dir))
            routing_config = RoutingBenchConfig(
                folder,
                prompts=prompts,
                requests_per_prompt=requests_per_prompt,
                replicas=replicas,
                prompt_tokens=prompt_tokens,
                concurrency=concurrency or 8,
            )
            result = run_routing_bench(routing_config).as_dict()
            title = f"gateway bench --routing ({folder.name}, {replicas} replicas)"
        else:
            from tether.gateway.bench import BenchConfig, run_bench

            result = run_bench(BenchConfig(requests, duration_s, concurrency or 32, warmup)).as_dict()
            title = "gateway bench (instant upstream)"
    warn_if_busy(result["machine"])
    if as_json:
        print_json(result)
        return
    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        shown = "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)
        table.add_row(key, shown)
    console.print(table)
