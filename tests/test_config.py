"""Layered settings: defaults < TOML file < TETHER_* environment < flags, with errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tether.config import load_settings, state_home
from tether.errors import ConfigError


def test_defaults_are_safe() -> None:
    settings = load_settings(environ={})
    assert settings.sandbox.spec.network == "none"
    assert settings.sandbox.spec.memory_mib == 512
    assert settings.sandbox.spec.timeout_s == 30
    assert settings.sandbox.insecure is False


def test_each_layer_overrides_the_one_below(tmp_path: Path) -> None:
    config = tmp_path / "tether.toml"
    config.write_text("[sandbox]\nslots = 3\n[sandbox.spec]\ntimeout_s = 7\nmemory_mib = 300\n")
    environ = {"TETHER_SANDBOX__SPEC__TIMEOUT_S": "9", "TETHER_SANDBOX__SLOTS": "5"}
    settings = load_settings(config, environ=environ, flags={"sandbox.slots": 6})
    assert settings.sandbox.spec.memory_mib == 300  # file
    assert settings.sandbox.spec.timeout_s == 9  # environment beats file
    assert settings.sandbox.slots == 6  # flag beats environment


def test_config_file_from_environment_variable(tmp_path: Path) -> None:
    config = tmp_path / "other.toml"
    config.write_text("log_level = 'debug'\n")
    assert load_settings(environ={"TETHER_CONFIG": str(config)}).log_level == "debug"


def test_json_values_in_environment() -> None:
    settings = load_settings(environ={"TETHER_SANDBOX__SPEC__ENV": '{"A": "1"}'})
    assert settings.sandbox.spec.env == {"A": "1"}


@pytest.mark.parametrize(
    ("environ", "flags", "expected"),
    [
        ({"TETHER_SANDBOX__SLOTS": "many"}, {}, "setting sandbox.slots = 'many' (from environment)"),
        ({}, {"sandbox.spec.memory_mib": -5}, "sandbox.spec.memory_mib = -5 (from command-line flag)"),
        ({"TETHER_SANDBOX__SPEC__NETWORK": "host"}, {}, "sandbox.spec.network = 'host'"),
        ({"TETHER_LOG_LEVEL": "loud"}, {}, "'debug', 'info', 'warning' or 'error'"),
        ({"TETHER_SANDBOX__SLOTZ": "2"}, {}, "unknown setting 'sandbox.slotz' (from environment)"),
        ({"TETHER_SANDBOX__SPEC__ENV": "{not json"}, {}, "is not valid JSON"),
    ],
)
def test_bad_values_name_key_value_and_source(
    environ: dict[str, str], flags: dict[str, object], expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(environ=environ, flags=flags)
    assert expected in str(caught.value)


def test_unknown_key_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(environ={"TETHER_SANDBOX__SPEC__TIMEOUT": "3"})
    assert "timeout_s" in str(caught.value) and "memory_mib" in str(caught.value)


def test_bad_toml_file_is_reported(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[sandbox\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_settings(config, environ={})


def test_missing_config_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "absent.toml", environ={})


def test_unknown_environment_variable_is_ignored_with_a_warning() -> None:
    warnings: list[str] = []
    environ = {"TETHER_BAR_SECRET": "1", "TETHER_LOGLEVEL": "debug", "TETHER_SANDBOX__SLOTS": "3"}
    settings = load_settings(environ=environ, warn=warnings.append)
    assert settings.sandbox.slots == 3
    assert warnings == [
        "ignoring environment variable TETHER_BAR_SECRET: not a tether setting",
        "ignoring environment variable TETHER_LOGLEVEL: not a tether setting; did you mean TETHER_LOG_LEVEL?",
    ]


def test_tooling_variables_are_neither_settings_nor_warned_about(tmp_path: Path) -> None:
    warnings: list[str] = []
    environ = {"TETHER_NO_SERVICES": "1", "TETHER_GATEWAY_CONFIG": "gw.toml", "TETHER_HOME": str(tmp_path)}
    load_settings(environ=environ, warn=warnings.append)
    assert warnings == []


def test_unknown_key_in_a_file_is_an_error_naming_the_nearest_key(tmp_path: Path) -> None:
    config = tmp_path / "tether.toml"
    config.write_text("[sandbox]\nslot = 2\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(config, environ={})
    assert f"unknown setting 'sandbox.slot' (from config file {config})" in str(caught.value)
    assert str(caught.value).endswith("did you mean 'slots'?")


def test_state_home_comes_from_tether_home_else_the_xdg_state_dir(tmp_path: Path) -> None:
    assert state_home({"TETHER_HOME": str(tmp_path / "h"), "XDG_STATE_HOME": "/x"}) == tmp_path / "h"
    assert state_home({"XDG_STATE_HOME": str(tmp_path)}) == tmp_path / "tether"
    assert state_home({}) == Path.home() / ".local" / "state" / "tether"
    assert load_settings(environ={"TETHER_HOME": str(tmp_path)}).home == tmp_path


def test_home_in_a_file_is_refused_naming_the_variable(tmp_path: Path) -> None:
    config = tmp_path / "tether.toml"
    config.write_text("home = '/somewhere'\n")
    with pytest.raises(ConfigError, match="TETHER_HOME environment variable only"):
        load_settings(config, environ={})


def test_a_sandbox_fleet_is_set_by_list_or_by_discovery_name(tmp_path: Path) -> None:
    assert load_settings(environ={}).sandbox.remote is False
    fleet = '["http://10.0.0.5:8080", "https://sandbox-1:8443"]'
    settings = load_settings(environ={"TETHER_SANDBOX__FLEET": fleet})
    assert settings.sandbox.fleet == ["http://10.0.0.5:8080", "https://sandbox-1:8443"]
    assert settings.sandbox.remote is True
    config = tmp_path / "tether.toml"
    config.write_text('[sandbox]\ndiscovery = "dns+http://tether-sandbox.default.svc:8080"\n')
    assert load_settings(config, environ={}).sandbox.remote is True


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"TETHER_SANDBOX__FLEET": '["10.0.0.5:8080"]'}, "expected a sandbox server's base URL"),
        ({"TETHER_SANDBOX__FLEET": '["http://a:1/v1/run"]'}, "expected a sandbox server's base URL"),
        ({"TETHER_SANDBOX__FLEET": '["http://a:1", "http://a:1"]'}, "lists an instance twice"),
        ({"TETHER_SANDBOX__DISCOVERY": "http://sandbox:8080"}, "expected dns+http://NAME:PORT"),
        ({"TETHER_SANDBOX__DISCOVERY": "dns+http://sandbox"}, "expected dns+http://NAME:PORT"),
        (
            {"TETHER_SANDBOX__FLEET": '["http://a:1"]', "TETHER_SANDBOX__DISCOVERY": "dns+http://b:2"},
            "either sandbox.fleet or sandbox.discovery",
        ),
    ],
)
def test_a_bad_fleet_setting_names_what_is_accepted(environ: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError, match="sandbox") as caught:
        load_settings(environ=environ)
    assert expected in str(caught.value)
