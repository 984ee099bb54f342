"""Layered settings: defaults, then a TOML file, then `TETHER_*` environment variables, then flags.

Each layer is a nested mapping; they are merged key by key and validated once, so an error names the
key, the bad value, which layer it came from and what is accepted. Environment keys nest with a double
underscore: `TETHER_SANDBOX__SPEC__TIMEOUT_S=5` sets `sandbox.spec.timeout_s`. A `TETHER_*` variable
that names no setting at all is ignored with a warning (other tools share the prefix); an unknown key
in a file, or under a known section, is an error.

The state directory (`state_home`, `$TETHER_HOME`) holds everything tether persists: the agents'
journal, the job store, the gateway's ledger. It comes from the environment only, so that every
subsystem, including those that never load these settings, finds the same one.
"""

from __future__ import annotations

import json
import logging
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tether.errors import ConfigError, did_you_mean
from tether.sandbox.spec import SandboxSpec

ENV_PREFIX = "TETHER_"
HOME_ENV = "TETHER_HOME"
# Variables that steer tooling rather than configure tether; they never reach the settings model.
NON_SETTING_ENV = frozenset({"TETHER_CONFIG", "TETHER_NO_SERVICES", "TETHER_GATEWAY_CONFIG", HOME_ENV})
DEFAULT_CONFIG_FILE = Path("tether.toml")
Warn = Callable[[str], None]
_log = logging.getLogger(__name__)


def state_home(environ: Mapping[str, str] | None = None) -> Path:
    """`$TETHER_HOME`, else `$XDG_STATE_HOME/tether`, else `~/.local/state/tether` (absolute)."""
    environ = os.environ if environ is None else environ
    if environ.get(HOME_ENV):
        return Path(environ[HOME_ENV]).expanduser().absolute()
    base = environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base).expanduser().absolute() / "tether"


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tether"


class SandboxSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    slots: int = Field(
        default_factory=lambda: max(os.cpu_count() or 1, 1),
        ge=1,
        le=1024,
        description="Concurrent runs (one warm worker each).",
    )
    host_uid_base: int = Field(
        1_000_000,
        ge=1,
        description="Unprivileged host uid of the sandbox's root: at least 65536, except inside a user "
        "namespace (a hostUsers: false pod maps only 0-65535, all unprivileged on the node).",
    )
    insecure: bool = Field(False, description="Start even if cgroups or seccomp are missing.")
    session_idle_timeout_s: float = Field(600.0, gt=0, description="Idle sessions are closed after this.")
    spec: SandboxSpec = Field(default_factory=SandboxSpec, description="Default limits of every run.")
    fleet: list[str] = Field(
        default_factory=list,
        description="`tether sandbox serve` instances (http(s) base URLs) to run on instead of a local pool.",
    )
    discovery: str | None = Field(
        None,
        description="A DNS name that lists the fleet, re-resolved while running: dns+http://NAME:PORT "
        "(e.g. a Kubernetes headless Service). Instead of `fleet`.",
    )

    @field_validator("fleet")
    @classmethod
    def _fleet_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
                raise ValueError(f"{url!r}: expected a sandbox server's base URL like http://10.0.0.5:8080")
        if len(set(urls)) != len(urls):
            raise ValueError(f"{urls!r}: lists an instance twice")
        return urls

    @field_validator("discovery")
    @classmethod
    def _discovery_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("dns+http", "dns+https") or not parts.hostname or parts.port is None:
            raise ValueError(f"{url!r}: expected dns+http://NAME:PORT (a name whose A records are the fleet)")
        return url

    @model_validator(mode="after")
    def _one_fleet_source(self) -> SandboxSettings:
        if self.fleet and self.discovery:
            raise ValueError("give either sandbox.fleet or sandbox.discovery, not both")
        return self

    @property
    def remote(self) -> bool:
        """Runs go to a fleet of sandbox servers rather than a pool in this process."""
        return bool(self.fleet or self.discovery)


class TetherSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cache_dir: Path = Field(default_factory=_default_cache_dir, description="Models, datasets, caches.")
    home: Path = Field(
        # A lambda: pydantic passes the validated data to a factory that takes one argument.
        default_factory=lambda: state_home(),
        description="State directory ($TETHER_HOME): agents' journal, job store, gateway ledger.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings)


Layer = tuple[str, dict[str, Any]]


def _merge(
    base: dict[str, Any], overlay: Mapping[str, Any], source: str, origins: dict[str, str], prefix: str = ""
) -> None:
    for key, value in overlay.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value, source, origins, f"{path}.")
        elif isinstance(value, Mapping):
            base[key] = {}
            _merge(base[key], value, source, origins, f"{path}.")
        else:
            base[key] = value
            origins[path] = source


def file_layer(path: Path) -> Layer:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {error}") from None
    if "home" in data:
        raise ConfigError(
            f"config file {str(path)!r}: 'home' is set by the {HOME_ENV} environment variable only "
            "(the gateway and the job store read it there too)"
        )
    return f"config file {path}", data


def env_layer(environ: Mapping[str, str], warn: Warn = _log.warning) -> Layer:
    """`TETHER_*` variables as a layer; one that names no top-level setting is reported to `warn`
    and skipped, since other programs may use the prefix for their own variables."""
    data: dict[str, Any] = {}
    sections = [name for name in TetherSettings.model_fields if name != "home"]
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name in NON_SETTING_ENV:
            continue
        keys = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        if keys[0] not in sections:
            hint = did_you_mean(keys[0], sections, lambda section: f"{ENV_PREFIX}{section.upper()}")
            warn(f"ignoring environment variable {name}: not a tether setting{hint}")
            continue
        if any(not key for key in keys):
            raise ConfigError(f"environment variable {name}: empty key segment; nest with '__' between names")
        value: Any = raw
        if raw[:1] in "{[":
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as error:
                raise ConfigError(
                    f"environment variable {name} = {raw!r} is not valid JSON: {error}"
                ) from None
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"environment variable {name} conflicts with another TETHER_ variable")
        node[keys[-1]] = value
    return "environment", data


def flags_layer(flags: Mapping[str, Any]) -> Layer:
    """Dotted keys (`sandbox.slots`) from command-line flags; None means the flag was not given."""
    data: dict[str, Any] = {}
    for dotted, value in flags.items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return "command-line flag", data


def _known_keys(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return sorted(model.model_fields)


def build_settings(layers: list[Layer]) -> TetherSettings:
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for source, data in layers:
        _merge(merged, data, source, origins)
    try:
        return TetherSettings.model_validate(merged)
    except ValidationError as error:
        lines = []
        for problem in error.errors():
            key = ".".join(str(part) for part in problem["loc"])
            origin = origins.get(key, "defaults")
            if problem["type"] == "extra_forbidden":
                known = _known_keys(TetherSettings, problem["loc"])
                hint = did_you_mean(str(problem["loc"][-1]), known)
                lines.append(
                    f"unknown setting {key!r} (from {origin}); known keys here: {', '.join(known)}{hint}"
                )
            else:
                lines.append(f"setting {key} = {problem['input']!r} (from {origin}): {problem['msg']}")
        raise ConfigError("\n".join(lines)) from None


def load_settings(
    config_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    warn: Warn = _log.warning,
) -> TetherSettings:
    """Settings from every layer. `config_file` falls back to $TETHER_CONFIG, then ./tether.toml;
    `warn` receives what is ignored (a `TETHER_*` variable that is no setting)."""
    environ = os.environ if environ is None else environ
    layers: list[Layer] = []
    path = config_file or (Path(environ["TETHER_CONFIG"]) if environ.get("TETHER_CONFIG") else None)
    if path is None and DEFAULT_CONFIG_FILE.is_file():
        path = DEFAULT_CONFIG_FILE
    if path is not None:
        layers.append(file_layer(path))
    layers.append(env_layer(environ, warn))
    layers.append(flags_layer(flags or {}))
    home = {"home": state_home(environ)}
    return build_settings([("environment", home), *layers])
