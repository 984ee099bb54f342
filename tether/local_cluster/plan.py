"""From a `ClusterFile` to the processes that make the cluster: argv, environment, port, health URL and
what each must wait for. Pure: no process is started and no file is written here.

The wiring lives here and only here: engine URLs go into the gateway's one pool, sandbox URLs into the
agent workers' `TETHER_SANDBOX__FLEET`, and each worker asks one engine replica (worker i: replica
i mod replicas) directly, since a worker has no gateway key to send.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tether.errors import ConfigError
from tether.local_cluster.config import ClusterFile, SupervisorSection

FLEET_ENV = "TETHER_SANDBOX__FLEET"
GATEWAY_CONFIG = "gateway.json"


class PieceKind(StrEnum):
    SANDBOX = "sandbox"
    ENGINE = "engine"
    GATEWAY = "gateway"
    WORKER = "worker"


class ServiceKind(StrEnum):
    POSTGRESQL = "postgresql"
    REDIS = "redis"
    NATS = "nats"


SERVICE_SCHEMES: dict[str, ServiceKind] = {
    "postgresql": ServiceKind.POSTGRESQL,
    "postgres": ServiceKind.POSTGRESQL,
    "postgresql+psycopg": ServiceKind.POSTGRESQL,
    "redis": ServiceKind.REDIS,
    "rediss": ServiceKind.REDIS,
    "nats": ServiceKind.NATS,
}
DEFAULT_SERVICE_PORTS = {ServiceKind.POSTGRESQL: 5432, ServiceKind.REDIS: 6379, ServiceKind.NATS: 4222}


@dataclass(frozen=True, slots=True)
class Service:
    """An already running service a piece uses, checked before anything starts."""

    kind: ServiceKind
    host: str
    port: int
    used_by: str  # the config key that names it, e.g. "agents.bus"


@dataclass(frozen=True, slots=True)
class PieceSpec:
    name: str  # "sandbox-0", "engine-1", "gateway", "worker-0"
    kind: PieceKind
    argv: tuple[str, ...]
    env: dict[str, str]  # on top of the supervisor's own environment
    port: int
    url: str  # what clients use (for a worker: its metrics endpoint)
    health_url: str  # 200 means healthy
    after: tuple[str, ...] = ()  # pieces that must be healthy before this one starts


@dataclass(frozen=True, slots=True)
class ClusterPlan:
    name: str
    host: str
    state_dir: Path
    pieces: tuple[PieceSpec, ...]
    services: tuple[Service, ...]
    files: dict[str, str] = field(default_factory=dict)  # name in state_dir -> content, written first
    supervisor: SupervisorSection = field(default_factory=SupervisorSection)

    def piece(self, name: str) -> PieceSpec:
        for piece in self.pieces:
            if piece.name == name:
                return piece
        raise KeyError(name)


def served_model_name(model: str, is_folder: bool) -> str:
    """The name `tether serve --model MODEL` serves under: a plain model folder's own name, else MODEL."""
    return Path(model).name if is_folder else model


def plan_cluster(
    cluster: ClusterFile, state_dir: Path, python: str, model_is_folder: bool = False
) -> ClusterPlan:
    """Every process of `cluster`, in start order; `python` runs `-m tether`. Raises ConfigError for a
    config whose parts do not fit together (naming the keys), including two pieces on one port."""
    _check_sections(cluster)
    tether = (python, "-m", "tether")
    host = cluster.host
    pieces: list[PieceSpec] = []
    ports: dict[int, str] = {}

    def take(port: int, key: str, name: str) -> int:
        if port > 65535:
            raise ConfigError(f"{key}: {name} would listen on port {port}; ports go up to 65535")
        if port in ports:
            raise ConfigError(f"port {port} is used twice: by {ports[port]} and by {name} ({key})")
        ports[port] = f"{name} ({key})"
        return port

    sandbox_urls: list[str] = []
    if cluster.sandbox is not None:
        section = cluster.sandbox
        for i in range(section.instances):
            name = f"sandbox-{i}"
            port = take(section.base_port + i, "sandbox.base_port", name)
            argv = [
                *tether,
                "sandbox",
                "serve",
                "--host",
                host,
                "--port",
                str(port),
                "--slots",
                str(section.slots),
            ]
            argv += ["--spec", section.spec] if section.spec else []
            argv += ["--insecure"] if section.insecure else []
            url = f"http://{host}:{port}"
            sandbox_urls.append(url)
            pieces.append(
                PieceSpec(
                    name, PieceKind.SANDBOX, tuple(argv), dict(section.env), port, url, f"{url}/healthz"
                )
            )

    engine_urls: list[str] = []
    served = ""
    if cluster.engine is not None:
        engine = cluster.engine
        served = served_model_name(engine.model, model_is_folder)
        for i in range(engine.replicas):
            name = f"engine-{i}"
            port = take(engine.base_port + i, "engine.base_port", name)
            argv = [
                *tether, "serve", "--model", engine.model, "--host", host, "--port", str(port),
                "--kv-cache-mib", str(engine.kv_cache_mib), "--max-num-seqs", str(engine.max_num_seqs),
                "--device", engine.device, "--dtype", engine.dtype,
            ]  # fmt: skip
            url = f"http://{host}:{port}"
            engine_urls.append(url)
            pieces.append(
                PieceSpec(name, PieceKind.ENGINE, tuple(argv), dict(engine.env), port, url, f"{url}/healthz")
            )

    files: dict[str, str] = {}
    if cluster.gateway is not None:
        gateway = cluster.gateway
        port = take(gateway.port, "gateway.port", "gateway")
        files[GATEWAY_CONFIG] = json.dumps(_gateway_config(cluster, state_dir, engine_urls, served), indent=2)
        argv = [
            *tether, "gateway", "serve", "--gateway-config", str(state_dir / GATEWAY_CONFIG),
            "--host", host, "--port", str(port), "--log-level", "warning",
        ]  # fmt: skip
        url = f"http://{host}:{port}"
        engines = tuple(p.name for p in pieces if p.kind is PieceKind.ENGINE)
        pieces.append(
            PieceSpec(
                "gateway",
                PieceKind.GATEWAY,
                tuple(argv),
                dict(gateway.env),
                port,
                url,
                f"{url}/healthz",
                engines,
            )
        )

    if cluster.agents is not None:
        agents = cluster.agents
        before = tuple(p.name for p in pieces if p.kind in (PieceKind.SANDBOX, PieceKind.ENGINE))
        for i in range(agents.workers):
            name = f"worker-{i}"
            port = take(agents.metrics_base_port + i, "agents.metrics_base_port", name)
            argv = [*tether, "worker", "--home", str(state_dir / "agents"), "--bus-name", agents.bus_name]
            argv += ["--bus", agents.bus] if agents.bus else []
            argv += ["--store", agents.store] if agents.store else []
            if agents.model is not None:
                argv += ["--model", agents.model]
            else:
                argv += ["--base-url", f"{engine_urls[i % len(engine_urls)]}/v1", "--model", served]
            argv += ["--max-in-flight", str(agents.max_in_flight), "--metrics-port", str(port)]
            env = dict(agents.env)
            if sandbox_urls:
                env[FLEET_ENV] = json.dumps(sandbox_urls)
            url = f"http://127.0.0.1:{port}/metrics"  # the worker serves its metrics on loopback only
            pieces.append(PieceSpec(name, PieceKind.WORKER, tuple(argv), env, port, url, url, before))

    return ClusterPlan(
        cluster.name, host, state_dir, tuple(pieces), tuple(_services(cluster)), files, cluster.supervisor
    )


def _check_sections(cluster: ClusterFile) -> None:
    if not any((cluster.sandbox, cluster.engine, cluster.gateway, cluster.agents)):
        raise ConfigError(
            "the cluster config starts nothing: give at least one of [sandbox], [engine], [gateway], [agents]"
        )
    if cluster.gateway is not None and cluster.engine is None:
        raise ConfigError(
            "[gateway] fronts the engine replicas, but there is no [engine] section: add one (replicas >= 1)"
        )
    agents = cluster.agents
    if agents is not None:
        if agents.model is not None and not agents.model.startswith("scripted:"):
            raise ConfigError(
                f"agents.model = {agents.model!r}: only scripted:FILE is accepted; without it the workers "
                "ask the [engine] replicas for their model"
            )
        if agents.model is None and cluster.engine is None:
            raise ConfigError(
                "[agents] workers ask the engine replicas, but there is no [engine] section: "
                'add one or set agents.model = "scripted:FILE"'
            )


def _gateway_config(
    cluster: ClusterFile, state_dir: Path, engine_urls: list[str], served: str
) -> dict[str, Any]:
    gateway = cluster.gateway
    assert gateway is not None
    name = gateway.model or served
    config: dict[str, Any] = {
        **gateway.config,
        "models": {name: "engine"},
        "pools": {"engine": {"urls": engine_urls}},
        "ledger_url": gateway.ledger_url or f"sqlite:///{state_dir / 'gateway.db'}",
    }
    if name != served:
        config["upstream_models"] = {name: served}
    if gateway.redis_url:
        config["redis_url"] = gateway.redis_url
    return config


def _services(cluster: ClusterFile) -> list[Service]:
    urls: list[tuple[str, str | None]] = []
    if cluster.gateway is not None:
        urls += [
            ("gateway.ledger_url", cluster.gateway.ledger_url),
            ("gateway.redis_url", cluster.gateway.redis_url),
        ]
    if cluster.agents is not None:
        urls += [("agents.bus", cluster.agents.bus), ("agents.store", cluster.agents.store)]
    services = []
    for key, url in urls:
        if url is None:
            continue
        parts = urlsplit(url)
        kind = SERVICE_SCHEMES.get(parts.scheme)
        if kind is None:
            continue  # sqlite and the like: a file, nothing to reach
        try:
            port = parts.port or DEFAULT_SERVICE_PORTS[kind]
        except ValueError:
            raise ConfigError(f"{key} = {url!r}: the port is not a number") from None
        services.append(Service(kind, parts.hostname or "127.0.0.1", port, key))
    return services
