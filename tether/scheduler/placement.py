"""Placement strategies (where a gang's replicas go) and the cost of a spread-out placement.

A placer only reads the cluster state and returns a `Placement` or None; it never allocates. Gangs are
all-or-nothing: a placer returns every replica or none, and never puts a replica on a node whose free
accelerators, CPU or memory cannot hold it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from tether.scheduler.cluster import ClusterState, Placement, Topology
from tether.scheduler.job import Demand

NO_NODES: frozenset[int] = frozenset()
CROSS_ISLAND_SLOWDOWN = 1.3
CROSS_RACK_SLOWDOWN = 1.5


class Placer(Protocol):
    @property
    def name(self) -> str: ...

    def place(
        self, cluster: ClusterState, demand: Demand, replicas: int, exclude: frozenset[int] = NO_NODES
    ) -> Placement | None: ...


def _gang_too_big(cluster: ClusterState, demand: Demand, replicas: int) -> bool:
    return demand.accelerators * replicas > cluster.total_free


@dataclass(frozen=True, slots=True)
class FirstFit:
    """Topology-unaware: replicas go to the lowest-numbered nodes with room, like a plain bin-filler."""

    name: str = "first-fit"

    def place(
        self, cluster: ClusterState, demand: Demand, replicas: int, exclude: frozenset[int] = NO_NODES
    ) -> Placement | None:
        if _gang_too_big(cluster, demand, replicas):
            return None
        slots: list[tuple[int, int]] = []
        remaining = replicas
        free = cluster.free_accelerators
        for node in range(len(free)):
            if free[node] < demand.accelerators or node in exclude:
                continue
            take = min(cluster.replicas_fitting(node, demand), remaining)
            if take:
                slots.append((node, take))
                remaining -= take
                if not remaining:
                    return Placement(demand, tuple(slots))
        return None


def _fill(
    cluster: ClusterState,
    nodes: tuple[int, ...] | range,
    demand: Demand,
    replicas: int,
    exclude: frozenset[int],
) -> Placement | None:
    """Fewest nodes inside one domain: whole nodes first, then the tightest node for the remainder."""
    free, need = cluster.free_accelerators, demand.accelerators
    fits = [(cluster.replicas_fitting(n, demand), n) for n in nodes if free[n] >= need and n not in exclude]
    fits = [pair for pair in fits if pair[0] > 0]
    if sum(fit for fit, _ in fits) < replicas:
        return None
    fits.sort(reverse=True)
    slots: list[tuple[int, int]] = []
    remaining = replicas
    while remaining:
        tight = next((pair for pair in reversed(fits) if pair[0] >= remaining), None)
        if tight is not None:
            slots.append((tight[1], remaining))
            break
        fit, node = fits.pop(0)
        slots.append((node, fit))
        remaining -= fit
    return Placement(demand, tuple(slots))


@dataclass(frozen=True, slots=True)
class TopologyAware:
    """Packs each gang into the smallest domain that fits (node, island, rack, then cluster).

    Within a level it picks the domain with the least free capacity that still fits (best fit), so small
    jobs fill partly used islands and whole islands stay free for the gangs that need them.
    """

    name: str = "topology"

    def place(
        self, cluster: ClusterState, demand: Demand, replicas: int, exclude: frozenset[int] = NO_NODES
    ) -> Placement | None:
        if demand.accelerators == 0:
            return FirstFit().place(cluster, demand, replicas, exclude)
        if _gang_too_big(cluster, demand, replicas):
            return None
        need = demand.accelerators * replicas
        for bucket in cluster.nodes_by_free[need:]:
            for node in bucket:
                if node not in exclude and cluster.replicas_fitting(node, demand) >= replicas:
                    return Placement(demand, ((node, replicas),))
        topology = cluster.topology
        levels = (
            (topology.island_nodes, cluster.island_free),
            (topology.rack_nodes, cluster.rack_free),
        )
        for domains, free in levels:
            for domain in sorted((d for d in range(len(domains)) if free[d] >= need), key=free.__getitem__):
                if len(domains[domain]) > 1:
                    placement = _fill(cluster, domains[domain], demand, replicas, exclude)
                    if placement is not None:
                        return placement
        return _fill(cluster, range(len(topology.nodes)), demand, replicas, exclude)


PLACERS: dict[str, Placer] = {placer.name: placer for placer in (FirstFit(), TopologyAware())}


@dataclass(frozen=True, slots=True)
class InterconnectModel:
    """How much slower a gang runs when it is spread over more domains than it needs.

    A gang that fits one island but is split across islands pays `cross_island_slowdown`; one that fits
    one rack but spans racks pays `cross_rack_slowdown`. The defaults sit mid-range of published
    measurements: Philly (Jeon et al., ATC'19, §4) reports lower GPU utilization for gangs spread over more
    servers, and Gandiva (Xiao et al., OSDI'18, §2) measures intra-server locality worth from ~1x for
    compute-bound models up to ~2x for communication-heavy ones (VGG, LSTM language models); cross-rack
    traffic also crosses the oversubscribed spine, hence the larger factor. Figures recalled from the
    papers, not re-measured here.
    """

    cross_island_slowdown: float = CROSS_ISLAND_SLOWDOWN
    cross_rack_slowdown: float = CROSS_RACK_SLOWDOWN

    def __post_init__(self) -> None:
        if not 1.0 <= self.cross_island_slowdown <= self.cross_rack_slowdown:
            raise ValueError(
                f"need 1 <= cross_island_slowdown ({self.cross_island_slowdown}) "
                f"<= cross_rack_slowdown ({self.cross_rack_slowdown})"
            )

    def slowdown(self, placement: Placement, topology: Topology) -> float:
        """The factor by which this placement stretches the job's run time (1.0 when compact)."""
        accelerators = placement.accelerators
        if len(placement.slots) < 2 or accelerators == 0:
            return 1.0
        nodes = topology.nodes
        racks = {nodes[n].rack for n in placement.nodes}
        if len(racks) > math.ceil(accelerators / topology.largest_rack_accelerators):
            return self.cross_rack_slowdown
        islands = {nodes[n].island for n in placement.nodes}
        if len(islands) > math.ceil(accelerators / topology.largest_island_accelerators):
            return self.cross_island_slowdown
        return 1.0
