"""The Ray back end: placements translated into pinned placement-group bundles, with a fake and a real Ray."""

from __future__ import annotations

import types
from typing import Any

import pytest

from tether.scheduler.cluster import Placement
from tether.scheduler.job import Demand, Job, JobSpec
from tether.scheduler.policy import get_policy
from tether.scheduler.ray_backend import RayBackend, plan_placement_group, topology_from_ray_nodes
from tether.scheduler.state import Preempt, Start

GIB = 1024**3
RAY_NODES = [
    {
        "NodeID": "a",
        "Alive": True,
        "NodeManagerAddress": "10.0.0.1",
        "Resources": {"CPU": 32.0, "GPU": 8.0, "memory": 256 * GIB},
    },
    {
        "NodeID": "dead",
        "Alive": False,
        "NodeManagerAddress": "10.0.0.9",
        "Resources": {"CPU": 32.0, "GPU": 8.0},
    },
    {
        "NodeID": "b",
        "Alive": True,
        "NodeManagerAddress": "10.0.0.2",
        "Resources": {"CPU": 32.0, "GPU": 8.0, "memory": 256 * GIB},
    },
]


class FakeRay:
    """Stands in for the `ray` module: live nodes, and a record of placement-group calls."""

    def __init__(self) -> None:
        self.created: list[tuple[list[dict[str, float]], str, str]] = []
        self.removed: list[str] = []
        self.util = types.SimpleNamespace(placement_group=self._create, remove_placement_group=self._remove)

    def nodes(self) -> list[dict[str, Any]]:
        return RAY_NODES

    def _create(self, bundles: list[dict[str, float]], strategy: str, name: str) -> str:
        self.created.append((bundles, strategy, name))
        return name

    def _remove(self, group: str) -> None:
        self.removed.append(group)


def test_live_ray_nodes_become_one_island_each() -> None:
    topology, addresses = topology_from_ray_nodes(RAY_NODES)
    assert addresses == ["10.0.0.1", "10.0.0.2"]
    assert [(n.accelerators, n.cpus, n.memory_mib) for n in topology.nodes] == [(8, 32.0, 262144)] * 2
    assert topology.island_nodes == ((0,), (1,)) and topology.rack_nodes == ((0, 1),)


def test_a_cluster_without_live_nodes_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no live nodes"):
        topology_from_ray_nodes([RAY_NODES[1]])


def test_a_single_node_gang_is_strict_pack_with_pinned_bundles() -> None:
    demand = Demand(accelerators=1, cpus=4, memory_mib=1024)
    plan = plan_placement_group("job1", Placement(demand, ((1, 2),)), ["10.0.0.1", "10.0.0.2"])
    bundle = {"node:10.0.0.2": 0.001, "CPU": 4.0, "GPU": 1.0, "memory": 1024 * 1024 * 1024.0}
    assert (plan.name, plan.strategy, plan.bundles) == ("tether-job1", "STRICT_PACK", (bundle, bundle))


def test_a_multi_node_gang_is_pack_with_each_replica_on_its_node() -> None:
    demand = Demand(accelerators=0, cpus=2, memory_mib=0)
    plan = plan_placement_group("job2", Placement(demand, ((0, 1), (1, 2))), ["10.0.0.1", "10.0.0.2"])
    assert plan.strategy == "PACK"
    assert [sorted(b) for b in plan.bundles] == [
        ["CPU", "node:10.0.0.1"],
        ["CPU", "node:10.0.0.2"],
        ["CPU", "node:10.0.0.2"],
    ]


def test_the_backend_creates_and_removes_groups_as_the_policy_decides() -> None:
    ray = FakeRay()
    backend = RayBackend(get_policy("priority"), ray=ray)
    gpu = Demand(accelerators=1, cpus=1, memory_mib=0)
    backend.state.submit(Job(JobSpec("low", gpu, replicas=16, priority=0)))
    assert [type(d) for d in backend.schedule(0.0)] == [Start]
    assert ray.created[0][1] == "PACK" and len(ray.created[0][0]) == 16
    backend.state.submit(Job(JobSpec("urgent", gpu, replicas=8, priority=3)))
    assert [type(d) for d in backend.schedule(1.0)] == [Preempt, Start]
    assert ray.removed == ["tether-low"]
    assert ray.created[1][1:] == ("STRICT_PACK", "tether-urgent")
    backend.finish("urgent", 2.0)
    assert ray.removed == ["tether-low", "tether-urgent"]


@pytest.mark.slow
def test_a_real_local_ray_reserves_the_planned_group() -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        backend = RayBackend(get_policy("topology"))
        backend.state.submit(
            Job(JobSpec("gang", Demand(accelerators=0, cpus=0.5, memory_mib=64), replicas=2))
        )
        assert [type(d) for d in backend.schedule(0.0)] == [Start]
        group = backend.groups["gang"]
        ray.get(group.ready(), timeout=30)
        table = ray.util.placement_group_table(group)
        assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 2
        backend.finish("gang", 1.0)
    finally:
        ray.shutdown()
