"""The plan of a cluster.toml, without starting anything: which processes, wired how, and a clear error
naming the key and value for every config whose parts do not fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tether.errors import ConfigError
from tether.local_cluster import PieceKind, ServiceKind, load_cluster_file, parse_cluster_file, plan_cluster
from tether.local_cluster.plan import FLEET_ENV, GATEWAY_CONFIG, served_model_name

STATE = Path("/state/clusters/local")
FULL: dict[str, Any] = {
    "sandbox": {"instances": 3, "base_port": 8081},
    "engine": {"replicas": 2, "model": "smollm2-135m-instruct", "base_port": 8001},
    "gateway": {"port": 4000},
    "agents": {"workers": 3, "metrics_base_port": 9101},
}


def plan(data: dict[str, Any], model_is_folder: bool = False) -> Any:
    return plan_cluster(parse_cluster_file(data), STATE, "/py", model_is_folder)


def test_pieces_start_in_dependency_order_with_their_own_ports() -> None:
    pieces = plan(FULL).pieces
    names = "sandbox-0 sandbox-1 sandbox-2 engine-0 engine-1 gateway worker-0 worker-1 worker-2"
    assert [p.name for p in pieces] == names.split()
    assert [p.port for p in pieces] == [8081, 8082, 8083, 8001, 8002, 4000, 9101, 9102, 9103]
    assert all(p.argv[:3] == ("/py", "-m", "tether") for p in pieces)
    by_name = {p.name: p for p in pieces}
    assert by_name["sandbox-0"].after == by_name["engine-0"].after == ()
    assert by_name["gateway"].after == ("engine-0", "engine-1")
    assert set(by_name["worker-0"].after) == {"sandbox-0", "sandbox-1", "sandbox-2", "engine-0", "engine-1"}
    assert by_name["engine-1"].health_url == "http://127.0.0.1:8002/healthz"
    assert by_name["worker-1"].health_url == "http://127.0.0.1:9102/metrics"


def test_engine_urls_fill_the_gateway_pool_and_sandbox_urls_the_workers_fleet() -> None:
    planned = plan(FULL)
    gateway = json.loads(planned.files[GATEWAY_CONFIG])
    assert gateway["pools"] == {"engine": {"urls": ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]}}
    assert gateway["models"] == {"smollm2-135m-instruct": "engine"}
    assert gateway["ledger_url"] == f"sqlite:///{STATE / 'gateway.db'}"
    argv = planned.piece("gateway").argv
    assert argv[argv.index("--gateway-config") + 1] == str(STATE / GATEWAY_CONFIG)
    fleet = ["http://127.0.0.1:8081", "http://127.0.0.1:8082", "http://127.0.0.1:8083"]
    for i in range(3):
        worker = planned.piece(f"worker-{i}")
        assert json.loads(worker.env[FLEET_ENV]) == fleet
        # worker i asks replica i mod 2, directly (a worker has no gateway key)
        assert worker.argv[worker.argv.index("--base-url") + 1] == f"http://127.0.0.1:{8001 + i % 2}/v1"
        assert worker.argv[worker.argv.index("--home") + 1] == str(STATE / "agents")


def test_a_model_folder_is_served_under_its_folder_name_and_the_gateway_may_rename_it() -> None:
    assert served_model_name("/models/tiny", is_folder=True) == "tiny"
    assert served_model_name("smollm2-135m-instruct", is_folder=False) == "smollm2-135m-instruct"
    data = {"engine": {"model": "/models/tiny"}, "gateway": {"model": "chat", "config": {"key_cache_s": 1}}}
    gateway = json.loads(plan(data, model_is_folder=True).files[GATEWAY_CONFIG])
    assert gateway["models"] == {"chat": "engine"} and gateway["upstream_models"] == {"chat": "tiny"}
    assert gateway["key_cache_s"] == 1


def test_section_env_reaches_its_processes_only() -> None:
    data = {**FULL, "engine": {**FULL["engine"], "env": {"OMP_NUM_THREADS": "1"}}}
    planned = plan(data)
    assert planned.piece("engine-1").env == {"OMP_NUM_THREADS": "1"}
    assert "OMP_NUM_THREADS" not in planned.piece("sandbox-0").env


def test_services_are_the_ones_the_config_uses() -> None:
    data = {
        **FULL,
        "gateway": {
            "port": 4000,
            "ledger_url": "postgresql://postgres@db:5433/test",
            "redis_url": "redis://r",
        },
        "agents": {"bus": "nats://127.0.0.1:4222", "store": "sqlite:////tmp/j.db"},
    }
    services = {(s.kind, s.host, s.port, s.used_by) for s in plan(data).services}
    assert services == {
        (ServiceKind.POSTGRESQL, "db", 5433, "gateway.ledger_url"),
        (ServiceKind.REDIS, "r", 6379, "gateway.redis_url"),
        (ServiceKind.NATS, "127.0.0.1", 4222, "agents.bus"),
    }
    assert plan(FULL).services == ()


def test_scripted_workers_need_no_engine() -> None:
    planned = plan({"agents": {"model": "scripted:/tmp/s.json"}})
    (worker,) = planned.pieces
    assert worker.kind is PieceKind.WORKER and "--base-url" not in worker.argv
    assert FLEET_ENV not in worker.env  # no [sandbox]: the worker keeps its own pool


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"sandbox": {"instances": 2, "base_port": 8001}, "engine": {"base_port": 8002}},
            "port 8002 is used twice: by sandbox-1 (sandbox.base_port) and by engine-0 (engine.base_port)",
        ),
        (
            {"engine": {"base_port": 4000}, "gateway": {"port": 4000}},
            "port 4000 is used twice: by engine-0 (engine.base_port) and by gateway (gateway.port)",
        ),
        (
            {"sandbox": {"instances": 3, "base_port": 65534}},
            "sandbox.base_port: sandbox-2 would listen on port 65536; ports go up to 65535",
        ),
        ({"engine": {"replicas": 0}}, "engine.replicas = 0: Input should be greater than or equal to 1"),
        ({"sandbox": {"instances": 0}}, "sandbox.instances = 0: Input should be greater than or equal to 1"),
        ({"agents": {"workers": 0}}, "agents.workers = 0: Input should be greater than or equal to 1"),
        (
            {"sandbox": {"instance": 3}},
            "unknown key 'sandbox.instance' (value 3); "
            "known keys: base_port, env, insecure, instances, slots, spec",
        ),
        (
            {"engines": {"replicas": 2}},
            "unknown key 'engines' (value {'replicas': 2}); known keys: agents, engine",
        ),
        ({"gateway": {"port": 70000}}, "gateway.port = 70000: Input should be less than or equal to 65535"),
        ({"name": "My Cluster", "sandbox": {}}, "name = 'My Cluster': String should match pattern"),
        ({"gateway": {}}, "[gateway] fronts the engine replicas, but there is no [engine] section"),
        ({"agents": {}}, "[agents] workers ask the engine replicas, but there is no [engine] section"),
        (
            {"engine": {}, "agents": {"model": "gpt-4"}},
            "agents.model = 'gpt-4': only scripted:FILE is accepted",
        ),
        (
            {"engine": {}, "gateway": {"config": {"pools": {}}}},
            "gateway.config = {'pools': {}}: Value error, ['pools']: the cluster writes these keys itself",
        ),
        ({}, "the cluster config starts nothing"),
        (
            {"agents": {"bus": "redis://h:port", "model": "scripted:x"}},
            "agents.bus = 'redis://h:port': the port is not a number",
        ),
    ],
)
def test_bad_configs_are_refused_naming_key_and_value(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        plan(data)
    assert message in str(raised.value)


def test_a_file_that_is_not_toml_or_missing_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "cluster.toml"
    bad.write_text("[sandbox\n")
    with pytest.raises(ConfigError, match=f"cluster config {bad}: not valid TOML"):
        load_cluster_file(bad)
    with pytest.raises(ConfigError, match="cannot read it"):
        load_cluster_file(tmp_path / "absent.toml")


def test_the_example_config_plans(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "configs" / "cluster" / "local.toml"
    planned = plan_cluster(load_cluster_file(example), tmp_path, "/py")
    kinds = [p.kind for p in planned.pieces]
    assert kinds.count(PieceKind.SANDBOX) == 3 and kinds.count(PieceKind.WORKER) == 1
    assert PieceKind.GATEWAY in kinds and PieceKind.ENGINE in kinds
