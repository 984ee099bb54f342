"""The cluster model: topology from a file, and free-capacity indexes that stay consistent."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scheduler.helpers import topology
from tether.errors import ConfigError
from tether.scheduler.cluster import ClusterState, Placement, Topology, default_cluster_config, load_cluster
from tether.scheduler.job import Demand

GPU = Demand(accelerators=1, cpus=1, memory_mib=1024)


def test_default_cluster_is_128_nodes_of_8_in_8_racks() -> None:
    shape = Topology.from_config(default_cluster_config())
    assert shape.summary() == {
        "name": "default-1024",
        "nodes": 128,
        "accelerators": 1024,
        "islands": 128,
        "racks": 8,
    }


def test_islands_and_racks_group_consecutive_nodes() -> None:
    shape = topology(nodes=8, nodes_per_island=2, nodes_per_rack=4)
    assert shape.island_nodes == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert shape.rack_nodes == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert shape.largest_island_accelerators == 16
    assert [n.rack for n in shape.nodes] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("suffix", "text"),
    [
        (".toml", 'name = "lab"\n[[node_groups]]\ncount = 4\naccelerators = 4\nnodes_per_rack = 2\n'),
        (".yaml", "name: lab\nnode_groups:\n  - {count: 4, accelerators: 4, nodes_per_rack: 2}\n"),
        (".json", '{"name": "lab", "node_groups": [{"count": 4, "accelerators": 4, "nodes_per_rack": 2}]}'),
    ],
)
def test_cluster_files_in_every_format(tmp_path: Path, suffix: str, text: str) -> None:
    path = tmp_path / f"cluster{suffix}"
    path.write_text(text)
    shape = Topology.from_config(load_cluster(path))
    assert (shape.name, shape.accelerators, len(shape.rack_nodes)) == ("lab", 16, 2)


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("c.toml", "[[node_groups]]\ncount = 0\n", "node_groups.0.count = 0"),
        ("c.toml", "[[node_groups]]\ncount = 4\nnodes_per_island = 3\n", "an island cannot span racks"),
        ("c.toml", "[[node_groups]]\ncount = 4\ngpus = 8\n", "unknown key 'node_groups.0.gpus'"),
        ("c.toml", "node_groups = []\n", "node_groups = []"),
        ("c.toml", "[[node_groups]\n", "is not valid TOML"),
        ("c.ini", "x=1", "unknown format '.ini'"),
        ("c.json", "[1, 2]", "must hold a table of keys"),
    ],
)
def test_bad_cluster_files_name_the_problem(tmp_path: Path, name: str, text: str, expected: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(
        ConfigError, match=expected.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")
    ):
        load_cluster(path)


def test_missing_cluster_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_cluster(tmp_path / "nope.toml")


def test_allocate_and_release_keep_every_index_consistent() -> None:
    cluster = ClusterState(topology(nodes=4, nodes_per_island=2, nodes_per_rack=2))
    placement = Placement(GPU, ((0, 8), (1, 3), (2, 1)))
    cluster.allocate(placement)
    assert cluster.free_accelerators == [0, 5, 7, 8]
    assert cluster.island_free == [5, 15]
    assert cluster.rack_free == [5, 15]
    assert cluster.total_free == 20
    assert list(cluster.nodes_by_free[0]) == [0]
    assert list(cluster.nodes_by_free[8]) == [3]
    assert cluster.whole_free_island_accelerators == 0
    assert cluster.fragmentation() == 1.0
    cluster.release(placement)
    assert cluster.free_accelerators == [8, 8, 8, 8]
    assert cluster.whole_free_island_accelerators == 32
    assert cluster.fragmentation() == 0.0
    assert cluster.free_cpu_milli == [64_000] * 4


def test_memory_limits_how_many_replicas_fit() -> None:
    cluster = ClusterState(topology(nodes=1, memory_gib=10))
    assert cluster.replicas_fitting(0, Demand(accelerators=1, cpus=1, memory_mib=4096)) == 2
    assert cluster.replicas_fitting(0, Demand(accelerators=1, cpus=1, memory_mib=20 * 1024)) == 0


def test_overcommitting_a_node_is_refused() -> None:
    cluster = ClusterState(topology(nodes=1))
    with pytest.raises(AssertionError, match="overcommitted"):
        cluster.allocate(Placement(GPU, ((0, 9),)))


@pytest.mark.parametrize("kwargs", [{"accelerators": -1}, {"accelerators": 0, "cpus": 0}, {"memory_mib": -5}])
def test_bad_demands_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must"):
        Demand(**kwargs)  # type: ignore[arg-type]
