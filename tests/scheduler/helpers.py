"""Small clusters and jobs for hand-checked scheduling scenarios."""

from __future__ import annotations

from tether.scheduler.cluster import ClusterConfig, ClusterState, NodeGroup, Topology
from tether.scheduler.job import Demand, Job, JobKind, JobSpec
from tether.scheduler.state import SchedulingState


def topology(
    nodes: int = 2,
    accelerators: int = 8,
    cpus: float = 64,
    memory_gib: float = 512,
    nodes_per_island: int = 1,
    nodes_per_rack: int = 16,
) -> Topology:
    group = NodeGroup(
        count=nodes,
        accelerators=accelerators,
        cpus=cpus,
        memory_gib=memory_gib,
        nodes_per_island=nodes_per_island,
        nodes_per_rack=nodes_per_rack,
    )
    return Topology.from_config(ClusterConfig(name="test", node_groups=[group]))


def state(shape: Topology | None = None) -> SchedulingState:
    return SchedulingState(ClusterState(shape or topology()))


def gpu_job(
    job_id: str,
    replicas: int,
    *,
    duration_s: float = 100.0,
    submit_s: float = 0.0,
    priority: int = 0,
    preemptible: bool = True,
    tenant: str = "default",
    memory_mib: int = 1024,
    checkpoint_interval_s: float = 1800.0,
) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        demand=Demand(accelerators=1, cpus=1, memory_mib=memory_mib),
        replicas=replicas,
        kind=JobKind.PRETRAIN,
        tenant=tenant,
        priority=priority,
        preemptible=preemptible,
        duration_s=duration_s,
        checkpoint_interval_s=checkpoint_interval_s,
        submit_s=submit_s,
    )


def submit(state: SchedulingState, *specs: JobSpec) -> list[Job]:
    jobs = [Job(spec) for spec in specs]
    for job in jobs:
        state.submit(job)
    return jobs
