"""`tether gateway keys|usage|bench` end to end through the CLI, on a SQLite ledger."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tether.chat import Usage
from tether.chat.pricing import Tier
from tether.cli.gateway import parse_since
from tether.cli.main import app
from tether.errors import ConfigError
from tether.gateway.config import GatewayConfig
from tether.gateway.ledger import Charge
from tether.gateway.runtime import open_stores
from tether.machine import machine_record

runner = CliRunner()


@pytest.fixture
def ledger(tmp_path: Path) -> list[str]:
    return ["--ledger-url", f"sqlite:///{tmp_path / 'ledger.db'}"]


def test_keys_create_list_revoke(ledger: list[str]) -> None:
    created = runner.invoke(
        app,
        ["gateway", "keys", "create", "--tenant", "acme", "--tier", "fast", "--rpm", "5", "--json", *ledger],
    )
    assert created.exit_code == 0, created.output
    key = json.loads(created.stdout)
    assert key["key"].startswith("tk-") and key["tier"] == "fast"
    listed = runner.invoke(app, ["gateway", "keys", "list", "--json", *ledger])
    rows = json.loads(listed.stdout)
    assert [(r["key_id"], r["limits"], r["revoked"]) for r in rows] == [
        (key["key_id"], {"requests_per_minute": 5}, None)
    ]
    assert key["key"] not in listed.stdout
    revoked = runner.invoke(app, ["gateway", "keys", "revoke", key["key_id"], *ledger])
    assert revoked.exit_code == 0 and "revoked" in revoked.stdout
    assert json.loads(runner.invoke(app, ["gateway", "keys", "list", "--json", *ledger]).stdout)[0]["revoked"]
    again = runner.invoke(app, ["gateway", "keys", "revoke", key["key_id"], *ledger])
    assert again.exit_code == 2 and "already revoked" in again.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["keys", "create", "--tenant", "bad tenant"], "tenant 'bad tenant'"),
        (["keys", "create", "--tenant", "a", "--budget-usd", "lots"], "--budget-usd 'lots'"),
        (["keys", "create", "--tenant", "a", "--budget-usd", "-1"], "budget_usd"),
        (["keys", "create", "--tenant", "a", "--tier", "turbo"], "turbo"),
        (["keys", "revoke", "nope"], "no such key"),
        (["usage", "--tenant", "a", "--since", "last week"], "--since 'last week'"),
    ],
)
def test_bad_cli_input_exits_nonzero_with_a_message(ledger: list[str], args: list[str], message: str) -> None:
    result = runner.invoke(app, ["gateway", *args, *ledger])
    assert result.exit_code == 2 and message in result.output, result.output


def test_bad_gateway_config_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "gw.toml"
    path.write_text("models = 3\n")
    result = runner.invoke(app, ["gateway", "keys", "list", "--gateway-config", str(path)])
    assert result.exit_code == 2 and str(path) in result.output and "models" in result.output


def test_usage_reports_by_day_model_and_tier_as_csv(ledger: list[str]) -> None:
    config = GatewayConfig(ledger_url=ledger[1])
    _, store = open_stores(config)
    now = dt.datetime.now(dt.UTC).timestamp()
    store.record(
        [
            Charge("a", now - 10, "acme", "k", "m", Tier.STANDARD, Usage(100, 40, 10), Decimal("0.0001942")),
            Charge("b", now - 5, "acme", "k", "m", Tier.FAST, Usage(10, 0, 1), Decimal("0.000055")),
            Charge("c", now - 9 * 86400, "acme", "k", "m", Tier.FAST, Usage(10, 0, 1), Decimal("1")),
        ]
    )
    result = runner.invoke(app, ["gateway", "usage", "--tenant", "acme", "--since", "1d", "--csv", *ledger])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [(r["tier"], r["prompt_tokens"], r["cached_tokens"], r["cost_usd"]) for r in rows] == [
        ("fast", "10", "0", "0.000055"),
        ("standard", "100", "40", "0.0001942"),
    ]
    everything = runner.invoke(
        app, ["gateway", "usage", "--tenant", "acme", "--since", "2000-01-01", "--json", *ledger]
    )
    assert sum(Decimal(r["cost_usd"]) for r in json.loads(everything.stdout)) == Decimal("1.0002492")


def test_since_accepts_durations_and_dates() -> None:
    now = dt.datetime(2026, 11, 30, 12, tzinfo=dt.UTC)
    assert parse_since("2d", now) == now.timestamp() - 2 * 86400
    assert parse_since("90m", now) == now.timestamp() - 5400
    assert parse_since("2026-11-01", now) == dt.datetime(2026, 11, 1, tzinfo=dt.UTC).timestamp()
    assert (
        parse_since("2026-11-01T00:00:00+01:00", now)
        == dt.datetime(2026, 10, 31, 23, tzinfo=dt.UTC).timestamp()
    )
    with pytest.raises(ConfigError, match="ISO date"):
        parse_since("yesterday", now)


def test_bench_reports_added_latency_and_max_rps() -> None:
    args = [
        "gateway",
        "bench",
        "--json",
        "--requests",
        "200",  # the kernel charges CPU time by 10 ms ticks: 30 requests' ~25 ms could read as 0
        "--warmup",
        "5",
        "--duration-s",
        "0.5",
        "--concurrency",
        "4",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert figures["gateway_p50_ms"] > 0 and figures["direct_p50_ms"] > 0
    assert figures["added_latency_p99_ms"] >= figures["added_latency_p50_ms"]
    assert figures["gateway_p99_ms"] >= figures["gateway_p50_ms"] > figures["added_latency_p50_ms"]
    assert figures["max_rps"] > 0 and figures["direct_max_rps"] > 0
    assert figures["gateway_cpu_ms_per_request"] > 0  # Linux: read from /proc
    assert machine_record(1, 0.0).keys() <= figures["machine"].keys()


@pytest.mark.parametrize("option", ["--requests", "--concurrency"])
def test_bench_refuses_nonsense_settings(option: str) -> None:
    result = runner.invoke(app, ["gateway", "bench", option, "0"])
    assert result.exit_code == 2 and option.removeprefix("--") in result.output


def test_every_gateway_option_has_help_and_serve_listens_on_4000() -> None:
    import typer.main

    from tether.cli.gateway import app as gateway_app

    group: Any = typer.main.get_command(gateway_app)
    commands = {name: command for name, command in group.commands.items() if name != "keys"}
    commands.update({f"keys {name}": command for name, command in group.commands["keys"].commands.items()})
    assert len(commands) == 6
    missing = [
        f"{name} {param.opts[0]}"
        for name, command in commands.items()
        for param in command.params
        if param.param_type_name == "option" and not param.help
    ]
    assert missing == []
    port = next(p for p in commands["serve"].params if p.name == "port")
    assert port.default == 4000  # LiteLLM's port; the sandbox server keeps 8080


def test_usage_of_an_empty_ledger_says_which_ledger_it_read(ledger: list[str]) -> None:
    result = runner.invoke(app, ["gateway", "usage", "--tenant", "nobody", "--json", *ledger])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == []
    assert "no usage of nobody" in result.stderr and ledger[-1] in " ".join(result.stderr.split())
