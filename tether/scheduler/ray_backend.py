"""The Ray back end: the core's gang placements carried out as Ray placement groups.

The cluster model is read from `ray.nodes()` (each Ray node one island; Ray reports no racks, so all
nodes share one). Each replica becomes one bundle pinned to the node the policy chose through Ray's
built-in `node:<ip>` resource; a gang on one node uses STRICT_PACK, a multi-node gang PACK. Ray is
imported only when a `RayBackend` is created; the translation functions are pure.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tether.scheduler.cluster import ClusterState, Node, Placement, Topology
from tether.scheduler.policy import Policy
from tether.scheduler.state import Decision, Preempt, SchedulingState

BYTES_PER_MIB = 1024 * 1024
# A sliver of the node's own resource pins a bundle to that node without using up anything real.
NODE_PIN = 0.001


@dataclass(frozen=True, slots=True)
class PlacementGroupPlan:
    name: str
    bundles: tuple[dict[str, float], ...]
    strategy: str


def topology_from_ray_nodes(
    nodes: Sequence[Mapping[str, Any]], name: str = "ray"
) -> tuple[Topology, list[str]]:
    """The cluster model of the live Ray nodes, and each node's address (index-aligned)."""
    alive = [n for n in nodes if n.get("Alive")]
    if not alive:
        raise RuntimeError("the Ray cluster reports no live nodes")
    models: list[Node] = []
    addresses: list[str] = []
    for index, node in enumerate(alive):
        resources = node.get("Resources", {})
        models.append(
            Node(
                index=index,
                name=str(node.get("NodeID", index)),
                accelerators=int(resources.get("GPU", 0)),
                cpus=float(resources.get("CPU", 0)),
                memory_mib=int(resources.get("memory", 0) // BYTES_PER_MIB),
                island=index,
                rack=0,
            )
        )
        addresses.append(str(node["NodeManagerAddress"]))
    largest = max(n.accelerators for n in models)
    topology = Topology(
        name=name,
        nodes=tuple(models),
        island_nodes=tuple((n.index,) for n in models),
        rack_nodes=(tuple(n.index for n in models),),
        largest_island_accelerators=largest,
        largest_rack_accelerators=sum(n.accelerators for n in models),
    )
    return topology, addresses


def plan_placement_group(job_id: str, placement: Placement, addresses: Sequence[str]) -> PlacementGroupPlan:
    """One bundle per replica, pinned to the node the core chose for it."""
    demand = placement.demand
    bundles: list[dict[str, float]] = []
    for node, count in placement.slots:
        bundle: dict[str, float] = {f"node:{addresses[node]}": NODE_PIN}
        if demand.cpus:
            bundle["CPU"] = demand.cpus
        if demand.accelerators:
            bundle["GPU"] = float(demand.accelerators)
        if demand.memory_mib:
            bundle["memory"] = float(demand.memory_mib * BYTES_PER_MIB)
        bundles.extend(dict(bundle) for _ in range(count))
    strategy = "STRICT_PACK" if len(placement.slots) == 1 else "PACK"
    return PlacementGroupPlan(name=f"tether-{job_id}", bundles=tuple(bundles), strategy=strategy)


class RayBackend:
    """Runs scheduling passes against a live Ray cluster; each started job owns one placement group."""

    def __init__(self, policy: Policy, ray: Any = None) -> None:
        self.ray = ray if ray is not None else importlib.import_module("ray")
        self._util = importlib.import_module("ray.util") if ray is None else ray.util
        self.policy = policy
        topology, self.addresses = topology_from_ray_nodes(self.ray.nodes())
        self.state = SchedulingState(ClusterState(topology))
        self.groups: dict[str, Any] = {}

    def schedule(self, now: float) -> list[Decision]:
        """Plan with the policy, then create or remove placement groups to match its decisions."""
        self.policy.schedule(self.state, now)
        applied: list[Decision] = []
        for decision in self.state.take_decisions():
            if isinstance(decision, Preempt):
                self._util.remove_placement_group(self.groups.pop(decision.job_id))
            else:
                # Ray cannot grow or reshape a placement group: a resized or repaired gang gets a new one.
                if decision.job_id in self.groups:
                    self._util.remove_placement_group(self.groups.pop(decision.job_id))
                plan = plan_placement_group(decision.job_id, decision.placement, self.addresses)
                self.groups[decision.job_id] = self._util.placement_group(
                    list(plan.bundles), strategy=plan.strategy, name=plan.name
                )
            applied.append(decision)
        return applied

    def finish(self, job_id: str, now: float) -> None:
        self.state.finish(job_id, now)
        self._util.remove_placement_group(self.groups.pop(job_id))
