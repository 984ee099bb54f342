"""SandboxSpec: safe defaults, units in names, and clear errors for unknown keys and bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from tether.errors import ConfigError
from tether.sandbox.spec import SandboxSpec, load_spec


def test_defaults() -> None:
    spec = SandboxSpec()
    assert (spec.memory_mib, spec.timeout_s, spec.network) == (512, 30, "none")
    assert spec.output_limit_bytes == 1024 * 1024


def test_toml_spec_file(tmp_path: Path) -> None:
    path = tmp_path / "spec.toml"
    path.write_text("timeout_s = 2\nmemory_mib = 256\n")
    spec = load_spec(path)
    assert (spec.timeout_s, spec.memory_mib) == (2, 256)


def test_yaml_spec_file(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("timeout_s: 3\npids_max: 16\nenv:\n  MODE: eval\n")
    spec = load_spec(path)
    assert (spec.timeout_s, spec.pids_max, spec.env) == (3, 16, {"MODE": "eval"})


@pytest.mark.parametrize(
    ("text", "suffix", "expected"),
    [
        ("timeout = 2\n", ".toml", "unknown key 'timeout'"),
        ("memory_mib = 1\n", ".toml", "memory_mib = 1"),
        ("timeout_s = 0\n", ".toml", "timeout_s = 0"),
        ("network = 'host'\n", ".toml", "network = 'host'"),
        ("cpu_limit = 'lots'\n", ".toml", "cpu_limit = 'lots'"),
        ("timeout_s = [\n", ".toml", "is not valid TOML"),
        ("- 1\n- 2\n", ".yaml", "must hold a table"),
        ("timeout_s: 1\n", ".json", "unknown format '.json'"),
    ],
)
def test_bad_spec_files_are_errors_naming_the_problem(
    tmp_path: Path, text: str, suffix: str, expected: str
) -> None:
    path = tmp_path / f"spec{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_spec(path)
    assert expected in str(caught.value)
    assert str(path) in str(caught.value)


def test_missing_spec_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_spec(tmp_path / "nope.toml")
