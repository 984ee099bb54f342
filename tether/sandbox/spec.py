"""`SandboxSpec`: the declarative limits of one run, with safe defaults and units in every name.

Loaded from Python, a TOML/YAML file (`--spec FILE`) or an HTTP request; unknown keys and bad values are
errors that name the key, the value and what is accepted.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from tether.errors import ConfigError, describe_validation_error, lone_surrogate
from tether.sandbox.paths import locate


def unicode_problem(text: str) -> str | None:
    """Why `text` cannot travel as UTF-8 (no program, file name or environment variable can), or None."""
    where = lone_surrogate(text)
    return None if where is None else f"holds {where}"


def _valid_unicode(text: str) -> str:
    problem = unicode_problem(text)
    if problem is not None:
        raise PydanticCustomError("invalid_text", problem)
    return text


# A string from outside that must be encodable as UTF-8; its validation error has the type `invalid_text`.
UnicodeText = Annotated[str, AfterValidator(_valid_unicode)]


class SandboxSpec(BaseModel):
    """Limits for one sandboxed run. Every limit is enforced by the kernel, not by the program."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_limit: float = Field(1.0, gt=0, le=64, description="CPU cores the run may use (cgroup CPU quota).")
    memory_mib: int = Field(
        512, ge=16, le=65536, description="Memory limit in MiB (cgroup); excess is OOM-killed."
    )
    pids_max: int = Field(64, ge=4, le=4096, description="Most processes and threads alive at once (cgroup).")
    timeout_s: float = Field(30.0, gt=0, le=3600, description="Wall-clock limit of each step in seconds.")
    compile_timeout_s: float = Field(30.0, gt=0, le=3600, description="Wall-clock limit of a compile step.")
    disk_mib: int = Field(
        64, ge=1, le=16384, description="Size of the run's tmpfs (workdir, /tmp, /dev/shm)."
    )
    network: Literal["none"] = Field("none", description="Network access; only 'none' (an empty namespace).")
    output_limit_kib: int = Field(
        1024, ge=1, le=262144, description="Cap on stdout and on stderr, each, in KiB."
    )
    open_files_max: int = Field(256, ge=16, le=65536, description="RLIMIT_NOFILE of the run.")
    env: dict[UnicodeText, UnicodeText] = Field(
        default_factory=dict, description="Extra environment variables for the run."
    )

    @field_validator("env")
    @classmethod
    def _env_is_passable(cls, env: dict[str, str]) -> dict[str, str]:
        for key, value in env.items():
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise ValueError(
                    f"environment entry {key!r}: names must be non-empty without '=' or NUL, "
                    "values without NUL"
                )
        return env

    @property
    def output_limit_bytes(self) -> int:
        return self.output_limit_kib * 1024

    def cpu_time_limit_s(self, timeout_s: float) -> int:
        """RLIMIT_CPU backstop: the wall timeout times the cores, rounded up, plus one second."""
        return int(timeout_s * self.cpu_limit) + 2


def checked_text(text: str, field: str) -> str:
    """`text` if it can travel as UTF-8; otherwise a ConfigError naming the field and the value."""
    problem = unicode_problem(text)
    if problem is not None:
        shown = repr(text) if len(text) <= 60 else repr(text[:57]) + "..."
        raise ConfigError(f"{field} = {shown}: {problem}")
    return text


def sandbox_path(path: str, field: str, workdir: str) -> str:
    """`path` if it names a file a run may write (see `paths.locate`), else a ConfigError naming it."""
    checked_text(path, field)
    try:
        locate(path, workdir)
    except ValueError as error:
        raise ConfigError(f"{field}: {error}") from None
    return path


def spec_from_mapping(data: dict[str, Any], source: str) -> SandboxSpec:
    try:
        return SandboxSpec.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, source, SandboxSpec)) from None


def load_spec(path: Path) -> SandboxSpec:
    """Read a spec from TOML (`.toml`) or YAML (`.yaml`/`.yml`)."""
    if not path.is_file():
        raise ConfigError(f"spec file {str(path)!r} does not exist")
    text = path.read_text()
    suffix = path.suffix.lower()
    # Only for a YAML spec: every pool imports this module, and yaml costs each command's start.
    import yaml

    try:
        if suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"spec file {str(path)!r}: unknown format {suffix!r}; use .toml, .yaml or .yml")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as error:
        raise ConfigError(f"spec file {str(path)!r} is not valid {suffix[1:].upper()}: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"spec file {str(path)!r} must hold a table of keys, not {type(data).__name__}")
    return spec_from_mapping(data, f"spec file {str(path)!r}")
