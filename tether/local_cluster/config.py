"""`cluster.toml`: the pieces of a local cluster, one section each, validated on load.

A missing section means no such piece; a present one starts at least one process. Cross-section rules
(a gateway needs engines, ports must not collide) are checked by `plan.plan_cluster`, which knows the
ports every piece ends up on. Nothing here does I/O except `load_cluster_file`, which reads one file.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tether.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables of this section's processes (on top of the caller's)."""


class SandboxSection(_Section):
    """`tether sandbox serve` instances on base_port, base_port + 1, ..."""

    instances: int = Field(1, ge=1)
    slots: int = Field(2, ge=1)
    """Concurrent runs (warm workers) of each instance."""
    base_port: int = Field(8081, ge=1, le=65535)
    spec: str | None = None
    """A TOML or YAML SandboxSpec file every instance runs with (default: the settings' spec)."""
    insecure: bool = False
    """Start even without cgroups or seccomp (`tether sandbox serve --insecure`)."""


class EngineSection(_Section):
    """`tether serve` replicas of one model on base_port, base_port + 1, ..."""

    replicas: int = Field(1, ge=1)
    model: str = "smollm2-135m-instruct"
    """A registered model, a model folder or a trained run, as `tether serve --model` takes it."""
    base_port: int = Field(8001, ge=1, le=65535)
    kv_cache_mib: int = Field(64, ge=1)
    """KV cache of each replica, in MiB."""
    max_num_seqs: int = Field(16, ge=1)
    device: str = "cpu"
    dtype: str = "float32"


class GatewaySection(_Section):
    """`tether gateway serve` in front of every engine replica (one pool)."""

    port: int = Field(4000, ge=1, le=65535)
    model: str | None = None
    """The name clients ask for (default: the name the engines serve the model under)."""
    ledger_url: str | None = None
    """Keys and usage: sqlite:///PATH or postgresql://... (default: gateway.db in the cluster's directory)."""
    redis_url: str | None = None
    """Shared limits across gateway instances (redis://...); none keeps them in the gateway process."""
    config: dict[str, Any] = Field(default_factory=dict)
    """More gateway settings (tier_priority, default_key_limits, ...), validated by the gateway itself."""

    @field_validator("config")
    @classmethod
    def _not_generated(cls, config: dict[str, Any]) -> dict[str, Any]:
        generated = sorted({"pools", "models", "upstream_models", "ledger_url", "redis_url"} & set(config))
        if generated:
            raise ValueError(
                f"{generated}: the cluster writes these keys itself (from [engine] and [gateway])"
            )
        return config


class AgentsSection(_Section):
    """`tether worker` processes on one queue; worker i asks engine replica i mod replicas."""

    workers: int = Field(1, ge=1)
    max_in_flight: int = Field(2, ge=1)
    """Tasks each worker runs at once."""
    bus: str | None = None
    """The task queue: redis://..., nats://... (default: SQLite in the cluster's directory)."""
    store: str | None = None
    """The journal: postgresql://... (default: SQLite in the cluster's directory)."""
    bus_name: str = "tether-tasks"
    model: str | None = None
    """`scripted:FILE` to replay a file instead of asking the engines (then [engine] is not needed)."""
    metrics_base_port: int = Field(9101, ge=1, le=65535)
    """Worker i serves Prometheus /metrics (its health check) on metrics_base_port + i."""


class SupervisorSection(BaseModel):
    """How the pieces are watched."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ready_timeout_s: float = Field(180.0, gt=0)
    """Longest wait for one piece's first health check to pass."""
    restart_limit: int = Field(5, ge=0)
    """Restarts of one piece after it exits; past this it stays down (status: failed)."""
    backoff_s: float = Field(1.0, gt=0)
    """Wait before the first restart; doubled for each further one."""
    backoff_max_s: float = Field(30.0, gt=0)
    stop_timeout_s: float = Field(15.0, gt=0)
    """Wait after SIGTERM before SIGKILL, per piece."""


class ClusterFile(BaseModel):
    """The whole `cluster.toml`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("local", pattern=r"^[a-z0-9][a-z0-9_-]{0,39}$")
    """The cluster's name: its state is $TETHER_HOME/clusters/NAME.json and NAME/."""
    host: str = "127.0.0.1"
    """Address every piece listens on."""
    sandbox: SandboxSection | None = None
    engine: EngineSection | None = None
    gateway: GatewaySection | None = None
    agents: AgentsSection | None = None
    supervisor: SupervisorSection = Field(default_factory=SupervisorSection)


SECTIONS: dict[str, type[BaseModel]] = {
    "sandbox": SandboxSection,
    "engine": EngineSection,
    "gateway": GatewaySection,
    "agents": AgentsSection,
    "supervisor": SupervisorSection,
}


def describe(error: ValidationError, source: str) -> str:
    """One line per problem, naming the key as `section.key`, its value, and what is accepted."""
    lines = []
    for problem in error.errors():
        loc = [str(part) for part in problem["loc"]]
        key = ".".join(loc) or "(root)"
        if problem["type"] == "extra_forbidden":
            model = SECTIONS.get(loc[0], ClusterFile) if len(loc) > 1 else ClusterFile
            known = ", ".join(sorted(model.model_fields))
            lines.append(f"{source}: unknown key {key!r} (value {problem['input']!r}); known keys: {known}")
        else:
            lines.append(f"{source}: {key} = {problem['input']!r}: {problem['msg']}")
    return "\n".join(lines)


def parse_cluster_file(data: dict[str, Any], source: str = "cluster config") -> ClusterFile:
    try:
        return ClusterFile.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe(error, source)) from None


def load_cluster_file(path: Path) -> ClusterFile:
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cluster config {path}: cannot read it: {error.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"cluster config {path}: not valid TOML: {error}") from None
    return parse_cluster_file(data, str(path))
