"""Loading the gateway config from TOML or JSON, and the errors for files that cannot be used."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from tether.chat.pricing import Tier
from tether.errors import ConfigError
from tether.gateway.config import load_gateway_config, parse_gateway_config

TOML = """
ledger_url = "postgresql://postgres@127.0.0.1:5432/test"
redis_url = "redis://127.0.0.1:6379/0"
models = { "smollm2" = "main" }
fast_pools = { "smollm2" = "vip" }

[pools.main]
urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
max_in_flight = 128

[pools.vip]
urls = ["http://10.0.0.3:8000"]

[prices.smollm2.standard]
output_per_mtok = "8.00"

[tenant_limits.acme]
tokens_per_window = 1000000
budget_usd = "2500"
"""


def test_a_toml_config_configures_pools_prices_and_tenants(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(TOML)
    config = load_gateway_config(path)
    assert (
        config.pool_for("smollm2", Tier.FAST) == "vip" and config.pool_for("smollm2", Tier.STANDARD) == "main"
    )
    assert config.pools["main"].max_in_flight == 128 and len(config.pools["main"].urls) == 2
    assert config.price("smollm2", Tier.STANDARD).output_per_mtok == Decimal("8.00")
    assert config.price("smollm2", Tier.STANDARD).input_cache_hit_per_mtok == Decimal("0.18")
    assert config.tenant("acme").budget_usd == Decimal(2500) and config.tenant("other").budget_usd is None


def test_json_configs_round_trip(tmp_path: Path) -> None:
    toml = tmp_path / "gateway.toml"
    toml.write_text(TOML)
    config = load_gateway_config(toml)
    path = tmp_path / "gateway.json"
    path.write_text(config.model_dump_json())
    assert load_gateway_config(path) == config


def test_no_file_means_the_defaults() -> None:
    config = load_gateway_config(None)
    assert config.price("default", Tier.FAST).output_per_mtok == Decimal("19.00")


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("missing.toml", None, "cannot read it"),
        ("bad.toml", "models = {", "not valid .toml"),
        ("bad.json", "{", "not valid .json"),
        ("typo.toml", "ledger_ur = 'x'", "unknown key 'ledger_ur'"),
        ("pool.toml", "[pools.default]\nurls = []\n", "pools.default.urls"),
        ("url.toml", "[pools.default]\nurls = ['10.0.0.1:8000']\n", "base URL like"),
        ("path.toml", "[pools.default]\nurls = ['http://h:1/v1']\n", "no path"),
    ],
)
def test_unusable_files_are_named_with_the_problem(
    tmp_path: Path, name: str, text: str | None, message: str
) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=message) as refused:
        load_gateway_config(path)
    assert str(path) in str(refused.value)


def test_the_defaults_front_tether_serve_with_its_defaults() -> None:
    import inspect

    from tether.cli.serve import serve_command

    serve = inspect.signature(serve_command).parameters
    config = load_gateway_config(None)
    assert list(config.models) == [serve["model"].default]
    pool = config.pools[config.models[serve["model"].default]]
    assert pool.urls == [f"http://{serve['host'].default}:{serve['port'].default}"]


def test_upstream_model_names_must_name_served_models() -> None:
    with pytest.raises(ConfigError, match="'chat' is configured but not served"):
        parse_gateway_config({"upstream_models": {"chat": "smollm2-135m-instruct"}})


def test_the_readme_example_is_a_valid_config(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = readme.split("A config for several models and pools", 1)[1].split("```toml\n", 1)[1]
    path = tmp_path / "gateway.toml"
    path.write_text(example.split("```", 1)[0])
    config = load_gateway_config(path)
    assert (
        config.pool_for("chat", Tier.FAST) == "large-fast" and config.upstream_model("chat") == "Qwen3-1.7B"
    )


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('url = "cache:6379"', "'cache:6379': expected a Redis URL like redis://cache:6379/0"),
        ('url = "http://cache:6379/0"', "expected a Redis URL"),
        ('url = "redis://:6379/0"', "expected a Redis URL"),
        ('url = "redis://cache:port/0"', "expected a Redis URL"),
        ('url = "redis://cache:6379/zero"', "expected a Redis URL"),
        ('url = "redis://cache"\nlease_s = 0', r"shared_admission.lease_s = 0: .*must be > 0 seconds"),
        ('url = "redis://cache"\nlease_s = -1.5', r"shared_admission.lease_s = -1.5: .*must be > 0 seconds"),
        ('url = "redis://cache"\npoll_s = 0', r"shared_admission.poll_s = 0: .*must be > 0 seconds"),
        ('url = "redis://cache"\npoll_s = 5', r"poll_s = 5.0 must be below lease_s / 3 = 3.33333"),
        ('url = "redis://cache"\non_store_down = "open"', r"on_store_down = 'open': .*'refuse' or 'local'"),
        ("lease_s = 5", "shared_admission.url"),
        ('url = "redis://cache"\nleases = 5', "unknown key"),
    ],
)
def test_bad_shared_admission_settings_are_named(tmp_path: Path, table: str, message: str) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(f"[shared_admission]\n{table}\n")
    with pytest.raises(ConfigError, match=message):
        load_gateway_config(path)


@pytest.mark.parametrize(
    "url", ["redis://cache", "redis://u:p@cache:6380/2", "rediss://cache/0", "unix:///r.sock"]
)
def test_shared_admission_takes_redis_urls(tmp_path: Path, url: str) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(f'[shared_admission]\nurl = "{url}"\nlease_s = 3\non_store_down = "local"\n')
    shared = load_gateway_config(path).shared_admission
    assert (
        shared is not None and shared.url == url and shared.lease_s == 3 and shared.on_store_down == "local"
    )
