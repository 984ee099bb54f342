"""Placers: all-or-nothing gangs, memory-aware nodes, compact packing, and the cost of spreading."""

from __future__ import annotations

import pytest

from tests.scheduler.helpers import topology
from tether.scheduler.cluster import ClusterState, Placement
from tether.scheduler.job import Demand
from tether.scheduler.placement import FirstFit, InterconnectModel, TopologyAware

GPU = Demand(accelerators=1, cpus=1, memory_mib=1024)
PLACERS = [FirstFit(), TopologyAware()]


def _busy(cluster: ClusterState, **used: int) -> None:
    """Occupy `used[f"n{i}"]` accelerators on node i."""
    for name, count in used.items():
        cluster.allocate(Placement(GPU, ((int(name[1:]), count),)))


@pytest.mark.parametrize("placer", PLACERS, ids=lambda p: p.name)
def test_a_gang_is_all_or_nothing(placer: FirstFit | TopologyAware) -> None:
    cluster = ClusterState(topology(nodes=2))
    _busy(cluster, n0=5, n1=5)
    assert placer.place(cluster, GPU, 7) is None
    placement = placer.place(cluster, GPU, 6)
    assert placement is not None and placement.replicas == 6


@pytest.mark.parametrize("placer", PLACERS, ids=lambda p: p.name)
def test_a_node_without_the_memory_is_never_used(placer: FirstFit | TopologyAware) -> None:
    shape = topology(nodes=2, memory_gib=64)
    cluster = ClusterState(shape)
    cluster.allocate(Placement(Demand(accelerators=0, cpus=1, memory_mib=40 * 1024), ((0, 1),)))
    hungry = Demand(accelerators=1, cpus=1, memory_mib=30 * 1024)
    placement = placer.place(cluster, hungry, 2)
    assert placement is not None and placement.slots == ((1, 2),)
    assert placer.place(cluster, hungry, 3) is None


def test_first_fit_splits_a_gang_that_topology_keeps_whole() -> None:
    cluster = ClusterState(topology(nodes=3))
    _busy(cluster, n0=4, n1=1)
    assert FirstFit().place(cluster, GPU, 8) == Placement(GPU, ((0, 4), (1, 4)))
    assert TopologyAware().place(cluster, GPU, 8) == Placement(GPU, ((2, 8),))


def test_topology_best_fits_small_jobs_into_partly_used_islands() -> None:
    cluster = ClusterState(topology(nodes=3))
    _busy(cluster, n1=6, n2=5)
    # Node 1 has exactly two free: the whole free node 0 stays whole for a later 8-GPU gang.
    assert TopologyAware().place(cluster, GPU, 2) == Placement(GPU, ((1, 2),))
    assert TopologyAware().place(cluster, GPU, 3) == Placement(GPU, ((2, 3),))


def test_topology_keeps_a_multi_node_gang_in_one_rack() -> None:
    cluster = ClusterState(topology(nodes=8, nodes_per_rack=4))
    _busy(cluster, n0=8, n1=8, n2=4, n5=2)
    # Rack 0 has 12 free, rack 1 has 30 free: 16 replicas only fit rack 1, on two whole nodes.
    placement = TopologyAware().place(cluster, GPU, 16)
    assert placement is not None
    assert [count for _, count in placement.slots] == [8, 8]
    assert {cluster.topology.nodes[n].rack for n in placement.nodes} == {1}
    assert 5 not in placement.nodes


def test_topology_fills_whole_nodes_then_the_tightest_node() -> None:
    cluster = ClusterState(topology(nodes=4, nodes_per_rack=4))
    _busy(cluster, n1=4, n2=6)
    placement = TopologyAware().place(cluster, GPU, 12)
    assert placement is not None
    assert sorted(placement.slots) in ([(0, 8), (1, 4)], [(1, 4), (3, 8)])


def test_topology_packs_a_gang_into_a_multi_node_island() -> None:
    cluster = ClusterState(topology(nodes=4, nodes_per_island=2, nodes_per_rack=4))
    _busy(cluster, n0=1, n2=4)
    placement = TopologyAware().place(cluster, GPU, 12)
    assert placement is not None
    assert {cluster.topology.nodes[n].island for n in placement.nodes} == {1}


@pytest.mark.parametrize("placer", PLACERS, ids=lambda p: p.name)
def test_excluded_nodes_are_skipped(placer: FirstFit | TopologyAware) -> None:
    cluster = ClusterState(topology(nodes=2))
    placement = placer.place(cluster, GPU, 2, exclude=frozenset({0}))
    assert placement is not None and placement.nodes == (1,)


def test_cpu_only_jobs_are_placed_by_cpu_and_memory() -> None:
    cluster = ClusterState(topology(nodes=2, cpus=16))
    sandbox = Demand(accelerators=0, cpus=12, memory_mib=1024)
    placement = TopologyAware().place(cluster, sandbox, 2)
    assert placement is not None and placement.slots == ((0, 1), (1, 1))
    assert TopologyAware().place(cluster, sandbox, 3) is None


@pytest.mark.parametrize(
    ("slots", "expected"),
    [
        (((0, 8),), 1.0),  # one island
        (((0, 4), (1, 4)), 1.3),  # fits one island, split over two
        (((0, 8), (1, 8)), 1.0),  # needs two islands, uses two in one rack
        (((0, 8), (1, 4), (2, 4)), 1.3),  # needs two islands, uses three
        (((0, 8), (4, 8)), 1.5),  # fits one rack, spans two
    ],
)
def test_interconnect_slowdown_counts_domains_beyond_the_minimum(
    slots: tuple[tuple[int, int], ...], expected: float
) -> None:
    shape = topology(nodes=8, nodes_per_rack=4)
    assert InterconnectModel().slowdown(Placement(GPU, slots), shape) == expected


@pytest.mark.parametrize(("island", "rack"), [(0.9, 1.5), (1.6, 1.5)])
def test_bad_slowdown_factors_are_refused(island: float, rack: float) -> None:
    with pytest.raises(ValueError, match="cross_island_slowdown"):
        InterconnectModel(island, rack)
