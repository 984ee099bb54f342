"""Layered settings: defaults < TOML file < TETHER_* environment < flags, with errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tether.config import load_settings
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
