"""The cluster model: nodes grouped in fast-interconnect islands and racks, and their free capacity.

`ClusterConfig` is the file format (TOML, YAML or JSON); `Topology` is the immutable shape built from it;
`ClusterState` tracks free capacity with incremental per-node, per-island and per-rack indexes so that
placement never rescans the whole cluster. An island never spans racks; a node sits in exactly one island.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tether.errors import ConfigError, describe_validation_error
from tether.scheduler.job import Demand

MIB_PER_GIB = 1024


class NodeGroup(BaseModel):
    """`count` identical nodes; consecutive nodes form islands, consecutive islands form racks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("node", min_length=1, description="Prefix of the node names.")
    count: int = Field(ge=1, le=100_000, description="Number of nodes.")
    accelerators: int = Field(8, ge=0, le=256, description="Accelerators per node.")
    cpus: float = Field(112.0, gt=0, le=4096, description="CPU cores per node.")
    memory_gib: float = Field(2048.0, gt=0, le=65536, description="Host memory per node in GiB.")
    nodes_per_island: int = Field(
        1, ge=1, le=1024, description="Nodes sharing one fast-interconnect domain (1: an 8-GPU NVLink box)."
    )
    nodes_per_rack: int = Field(16, ge=1, le=4096, description="Nodes per rack (one top-of-rack switch).")

    @model_validator(mode="after")
    def _islands_fit_in_racks(self) -> NodeGroup:
        if self.nodes_per_rack % self.nodes_per_island:
            raise ValueError(
                f"nodes_per_rack = {self.nodes_per_rack} must be a multiple of "
                f"nodes_per_island = {self.nodes_per_island}: an island cannot span racks"
            )
        return self


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "cluster"
    node_groups: list[NodeGroup] = Field(min_length=1, description="Node groups, racked in order.")


def default_cluster_config() -> ClusterConfig:
    """128 nodes of 8 accelerators (1,024 in all), one NVLink island per node, 16 nodes per rack."""
    return ClusterConfig(name="default-1024", node_groups=[NodeGroup(name="gpu", count=128)])


@dataclass(frozen=True, slots=True)
class Node:
    index: int
    name: str
    accelerators: int
    cpus: float
    memory_mib: int
    island: int
    rack: int


@dataclass(frozen=True, slots=True)
class Topology:
    name: str
    nodes: tuple[Node, ...]
    island_nodes: tuple[tuple[int, ...], ...]
    rack_nodes: tuple[tuple[int, ...], ...]
    largest_island_accelerators: int
    largest_rack_accelerators: int

    @classmethod
    def from_config(cls, config: ClusterConfig) -> Topology:
        nodes: list[Node] = []
        islands: list[list[int]] = []
        racks: list[list[int]] = []
        for group in config.node_groups:
            for offset in range(group.count):
                if offset % group.nodes_per_rack == 0:
                    racks.append([])
                if offset % group.nodes_per_island == 0:
                    islands.append([])
                index = len(nodes)
                nodes.append(
                    Node(
                        index=index,
                        name=f"{group.name}-{offset:04d}",
                        accelerators=group.accelerators,
                        cpus=group.cpus,
                        memory_mib=int(group.memory_gib * MIB_PER_GIB),
                        island=len(islands) - 1,
                        rack=len(racks) - 1,
                    )
                )
                islands[-1].append(index)
                racks[-1].append(index)
        return cls(
            name=config.name,
            nodes=tuple(nodes),
            island_nodes=tuple(tuple(i) for i in islands),
            rack_nodes=tuple(tuple(r) for r in racks),
            largest_island_accelerators=max(sum(nodes[n].accelerators for n in i) for i in islands),
            largest_rack_accelerators=max(sum(nodes[n].accelerators for n in r) for r in racks),
        )

    @property
    def accelerators(self) -> int:
        return sum(node.accelerators for node in self.nodes)

    def island_accelerators(self, island: int) -> int:
        return sum(self.nodes[n].accelerators for n in self.island_nodes[island])

    def rack_accelerators(self, rack: int) -> int:
        return sum(self.nodes[n].accelerators for n in self.rack_nodes[rack])

    def summary(self) -> dict[str, object]:
        return {
            "name": self.name,
            "nodes": len(self.nodes),
            "accelerators": self.accelerators,
            "islands": len(self.island_nodes),
            "racks": len(self.rack_nodes),
        }


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a gang runs: `(node index, replicas on that node)` pairs, each replica needing `demand`."""

    demand: Demand
    slots: tuple[tuple[int, int], ...]
    replicas: int = field(init=False, compare=False)
    accelerators: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        replicas = sum(count for _, count in self.slots)
        object.__setattr__(self, "replicas", replicas)
        object.__setattr__(self, "accelerators", replicas * self.demand.accelerators)

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(node for node, _ in self.slots)

    def plus(self, extra: Placement) -> Placement:
        """This placement grown by `extra` replicas of the same demand."""
        assert extra.demand == self.demand, "only replicas of one demand form a gang"
        counts = dict(self.slots)
        for node, count in extra.slots:
            counts[node] = counts.get(node, 0) + count
        return Placement(self.demand, tuple(sorted(counts.items())))


def _milli(cpus: float) -> int:
    return round(cpus * 1000)


class ClusterState:
    """Free capacity per node, with indexes kept up to date on every allocate and release."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        nodes = topology.nodes
        self.free_accelerators = [n.accelerators for n in nodes]
        self.free_cpu_milli = [_milli(n.cpus) for n in nodes]
        self.free_memory_mib = [n.memory_mib for n in nodes]
        self.island_capacity = [topology.island_accelerators(i) for i in range(len(topology.island_nodes))]
        self.rack_capacity = [topology.rack_accelerators(r) for r in range(len(topology.rack_nodes))]
        self.island_free = list(self.island_capacity)
        self.rack_free = list(self.rack_capacity)
        self.total_free = sum(self.free_accelerators)
        self.capacity = self.total_free
        # Nodes bucketed by free accelerators: best fit walks buckets upward instead of scanning nodes.
        self.nodes_by_free: list[dict[int, None]] = [{} for _ in range(max(self.free_accelerators) + 1)]
        for node in nodes:
            self.nodes_by_free[node.accelerators][node.index] = None
        self.whole_free_island_accelerators = sum(c for c in self.island_capacity if c > 0)

    def replicas_fitting(self, node: int, demand: Demand) -> int:
        """How many replicas of `demand` fit on `node` now (memory and CPU included)."""
        fit = self.free_accelerators[node] // demand.accelerators if demand.accelerators else 1 << 30
        if demand.cpu_milli:
            by_cpu = self.free_cpu_milli[node] // demand.cpu_milli
            fit = by_cpu if by_cpu < fit else fit
        if demand.memory_mib:
            by_memory = self.free_memory_mib[node] // demand.memory_mib
            fit = by_memory if by_memory < fit else fit
        return fit

    def allocate(self, placement: Placement) -> None:
        self._change(placement, -1)

    def release(self, placement: Placement) -> None:
        self._change(placement, +1)

    def _change(self, placement: Placement, sign: int) -> None:
        demand = placement.demand
        topology = self.topology
        for node, count in placement.slots:
            accelerators = sign * count * demand.accelerators
            self.free_cpu_milli[node] += sign * count * demand.cpu_milli
            self.free_memory_mib[node] += sign * count * demand.memory_mib
            assert self.free_cpu_milli[node] >= 0 and self.free_memory_mib[node] >= 0, "overcommitted node"
            if not accelerators:
                continue
            before = self.free_accelerators[node]
            after = before + accelerators
            assert 0 <= after <= topology.nodes[node].accelerators, "overcommitted accelerators"
            self.free_accelerators[node] = after
            del self.nodes_by_free[before][node]
            self.nodes_by_free[after][node] = None
            island = topology.nodes[node].island
            capacity = self.island_capacity[island]
            was_whole = self.island_free[island] == capacity
            self.island_free[island] += accelerators
            is_whole = self.island_free[island] == capacity
            self.whole_free_island_accelerators += capacity * (int(is_whole) - int(was_whole))
            self.rack_free[topology.nodes[node].rack] += accelerators
            self.total_free += accelerators

    def fragmentation(self) -> float:
        """Share of free accelerators stranded in partly used islands (0 when nothing is free)."""
        if self.total_free == 0:
            return 0.0
        return 1.0 - self.whole_free_island_accelerators / self.total_free


def _read_mapping(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{what} file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    text = path.read_text()
    try:
        if suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(
                f"{what} file {str(path)!r}: unknown format {suffix!r}; use .toml, .yaml, .yml or .json"
            )
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as error:
        raise ConfigError(f"{what} file {str(path)!r} is not valid {suffix[1:].upper()}: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} file {str(path)!r} must hold a table of keys, not {type(data).__name__}")
    return data


def load_cluster(path: Path) -> ClusterConfig:
    """Read a cluster description from TOML, YAML or JSON."""
    data = _read_mapping(path, "cluster")
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(
            describe_validation_error(error, f"cluster file {str(path)!r}", ClusterConfig)
        ) from None
