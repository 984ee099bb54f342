"""The Ray back end: the core's gang placements carried out as Ray placement groups.

The cluster model is read from `ray.nodes()` (each Ray node one island; Ray reports no racks, so all
nodes share one). Each replica becomes one bundle pinned to the node the policy chose through Ray's
built-in `node:<ip>` resource; a gang on one node uses STRICT_PACK, a multi-node gang PACK. A job
submitted with a command is launched into its group, one actor per bundle (`ray_launch`), with Ray's
GPU ids as `CUDA_VISIBLE_DEVICES`; a preemption stops those actors (SIGTERM, then SIGKILL after the
job's grace) before the group goes, and `poll` finishes jobs whose replicas have all exited. Ray is
imported only when a `RayBackend` is created; the translation functions are pure.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tether.scheduler.cluster import ClusterState, Node, Placement, Topology
from tether.scheduler.job import Job, JobSpec, JobState
from tether.scheduler.policy import Policy
from tether.scheduler.ray_launch import Launcher, RayLauncher
from tether.scheduler.state import Decision, Preempt, SchedulingState
from tether.scheduler.workload import WORKLOADS, WorkloadKind, has_checkpoint

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


@dataclass(frozen=True, slots=True)
class RayCommand:
    """What a job's replicas run: its argv, as a workload (a train job resumes from `run_dir`)."""

    command: tuple[str, ...]
    workload: WorkloadKind = WorkloadKind.COMMAND
    run_dir: str = ""
    stop_grace_s: float = 120.0


class RayBackend:
    """Runs scheduling passes against a live Ray cluster; each started job owns one placement group,
    and a job submitted with a command runs one replica actor in each of its bundles."""

    def __init__(self, policy: Policy, ray: Any = None, launcher: Launcher | None = None) -> None:
        self.ray = ray if ray is not None else importlib.import_module("ray")
        self._util = importlib.import_module("ray.util") if ray is None else ray.util
        self.policy = policy
        topology, self.addresses = topology_from_ray_nodes(self.ray.nodes())
        self.state = SchedulingState(ClusterState(topology))
        self.groups: dict[str, Any] = {}
        self.commands: dict[str, RayCommand] = {}
        self.replicas: dict[str, list[Any]] = {}
        self._launcher = launcher
        self.exits: dict[str, int] = {}

    @property
    def launcher(self) -> Launcher:
        if self._launcher is None:
            self._launcher = RayLauncher()
        return self._launcher

    def submit(self, spec: JobSpec, command: RayCommand | None = None) -> None:
        """Queue a job; with a command, its replicas are launched when it starts."""
        if command is not None:
            self.commands[spec.job_id] = command
        self.state.submit(Job(spec))

    def schedule(self, now: float) -> list[Decision]:
        """Plan with the policy, then create or remove placement groups (and replicas) to match."""
        self.policy.schedule(self.state, now)
        applied: list[Decision] = []
        for decision in self.state.take_decisions():
            self._stop(decision.job_id)
            if isinstance(decision, Preempt):
                self._util.remove_placement_group(self.groups.pop(decision.job_id))
            else:
                # Ray cannot grow or reshape a placement group: a resized or repaired gang gets a new one.
                if decision.job_id in self.groups:
                    self._util.remove_placement_group(self.groups.pop(decision.job_id))
                plan = plan_placement_group(decision.job_id, decision.placement, self.addresses)
                group = self._util.placement_group(list(plan.bundles), strategy=plan.strategy, name=plan.name)
                self.groups[decision.job_id] = group
                self._launch(decision.job_id, group, decision.placement)
            applied.append(decision)
        return applied

    def poll(self, now: float) -> dict[str, int]:
        """Finish the jobs whose replicas have all exited (failed if one failed); their exit codes."""
        finished: dict[str, int] = {}
        for job_id, handles in list(self.replicas.items()):
            codes = [self.launcher.poll(handle) for handle in handles]
            failed = next((c for c in codes if c), None)
            if failed is None and any(c is None for c in codes):
                continue
            code = failed or 0
            self._stop(job_id)
            self.state.finish(job_id, now, JobState.DONE if code == 0 else JobState.FAILED)
            self._util.remove_placement_group(self.groups.pop(job_id))
            self.exits[job_id] = finished[job_id] = code
        return finished

    def devices(self, job_id: str) -> list[str]:
        """`CUDA_VISIBLE_DEVICES` of each running replica of the job."""
        return [self.launcher.devices(handle) for handle in self.replicas.get(job_id, [])]

    def cancel(self, job_id: str, now: float) -> None:
        """Stop a running job's replicas and free its group, or take a queued job off the queue."""
        if job_id in self.state.running:
            self._stop(job_id)
            self.state.finish(job_id, now, JobState.CANCELLED)
            self._util.remove_placement_group(self.groups.pop(job_id))
            return
        queue = self.state.queue
        queued = next((job for job in queue.in_submit_order(len(queue)) if job.job_id == job_id), None)
        if queued is None:
            raise ValueError(f"no queued or running job {job_id!r} on this Ray back end")
        self.state.cancel_queued(queued, now)

    def finish(self, job_id: str, now: float) -> None:
        self._stop(job_id)
        self.state.finish(job_id, now)
        self._util.remove_placement_group(self.groups.pop(job_id))

    def _launch(self, job_id: str, group: Any, placement: Placement) -> None:
        command = self.commands.get(job_id)
        if command is None:
            return
        workload = WORKLOADS[command.workload]
        if workload.port_per_replica:
            raise ValueError(
                f"job {job_id}: the {workload.kind.value} workload needs ports, which Ray does not hand out"
            )
        argv = workload.replica_commands(
            command.command,
            placement.replicas,
            (),
            command.run_dir,
            workload.resumable and has_checkpoint(command.run_dir),
        )
        self.replicas[job_id] = [
            self.launcher.start(group, bundle, placement.demand, replica)
            for bundle, replica in enumerate(argv)
        ]

    def _stop(self, job_id: str) -> None:
        """Stop the job's replica actors, if it has any (SIGTERM, SIGKILL after the job's grace)."""
        handles = self.replicas.pop(job_id, [])
        grace_s = self.commands[job_id].stop_grace_s if job_id in self.commands else 0.0
        for handle in handles:
            self.launcher.stop(handle, grace_s)
