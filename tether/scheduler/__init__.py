"""The scheduler: one priority queue for mixed jobs, placement, preemption, stragglers, and a simulator.

The public names are loaded on first use, so that a command using one module (the job store of
`tether jobs`) does not import the simulator and its numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tether.scheduler.cluster import (
        ClusterConfig,
        ClusterState,
        NodeGroup,
        Placement,
        Topology,
        default_cluster_config,
        load_cluster,
    )
    from tether.scheduler.devices import assign_devices, detect_islands, parse_topology_matrix
    from tether.scheduler.job import Demand, Job, JobKind, JobSpec, JobState
    from tether.scheduler.local import LocalBackend, MachineCapacity
    from tether.scheduler.placement import FirstFit, InterconnectModel, Placer, TopologyAware
    from tether.scheduler.policy import POLICIES, Policy, QueuePolicy, get_policy, parse_policies
    from tether.scheduler.ray_backend import RayBackend, RayCommand, plan_placement_group
    from tether.scheduler.simulator import PolicyResult, SimConfig, simulate
    from tether.scheduler.state import Decision, Preempt, Replace, Resize, SchedulingState, Start
    from tether.scheduler.store import JobRecord, JobRequest, JobStore
    from tether.scheduler.straggler import StragglerConfig, StragglerDetector, find_stragglers, mitigate
    from tether.scheduler.trace import SyntheticTrace, load_trace, save_trace
    from tether.scheduler.workload import WORKLOADS, Workload, WorkloadKind, recognize

_EXPORTS = {
    "assign_devices": "tether.scheduler.devices",
    "detect_islands": "tether.scheduler.devices",
    "parse_topology_matrix": "tether.scheduler.devices",
    "RayCommand": "tether.scheduler.ray_backend",
    "WORKLOADS": "tether.scheduler.workload",
    "Workload": "tether.scheduler.workload",
    "WorkloadKind": "tether.scheduler.workload",
    "recognize": "tether.scheduler.workload",
    "ClusterConfig": "tether.scheduler.cluster",
    "ClusterState": "tether.scheduler.cluster",
    "Decision": "tether.scheduler.state",
    "Demand": "tether.scheduler.job",
    "FirstFit": "tether.scheduler.placement",
    "InterconnectModel": "tether.scheduler.placement",
    "Job": "tether.scheduler.job",
    "JobKind": "tether.scheduler.job",
    "JobRecord": "tether.scheduler.store",
    "JobRequest": "tether.scheduler.store",
    "JobSpec": "tether.scheduler.job",
    "JobState": "tether.scheduler.job",
    "JobStore": "tether.scheduler.store",
    "LocalBackend": "tether.scheduler.local",
    "MachineCapacity": "tether.scheduler.local",
    "NodeGroup": "tether.scheduler.cluster",
    "POLICIES": "tether.scheduler.policy",
    "Placement": "tether.scheduler.cluster",
    "Placer": "tether.scheduler.placement",
    "Policy": "tether.scheduler.policy",
    "PolicyResult": "tether.scheduler.simulator",
    "Preempt": "tether.scheduler.state",
    "QueuePolicy": "tether.scheduler.policy",
    "RayBackend": "tether.scheduler.ray_backend",
    "Replace": "tether.scheduler.state",
    "Resize": "tether.scheduler.state",
    "SchedulingState": "tether.scheduler.state",
    "SimConfig": "tether.scheduler.simulator",
    "Start": "tether.scheduler.state",
    "StragglerConfig": "tether.scheduler.straggler",
    "StragglerDetector": "tether.scheduler.straggler",
    "SyntheticTrace": "tether.scheduler.trace",
    "Topology": "tether.scheduler.cluster",
    "TopologyAware": "tether.scheduler.placement",
    "default_cluster_config": "tether.scheduler.cluster",
    "find_stragglers": "tether.scheduler.straggler",
    "get_policy": "tether.scheduler.policy",
    "load_cluster": "tether.scheduler.cluster",
    "load_trace": "tether.scheduler.trace",
    "mitigate": "tether.scheduler.straggler",
    "parse_policies": "tether.scheduler.policy",
    "plan_placement_group": "tether.scheduler.ray_backend",
    "save_trace": "tether.scheduler.trace",
    "simulate": "tether.scheduler.simulator",
}

__all__ = [
    "POLICIES",
    "WORKLOADS",
    "ClusterConfig",
    "ClusterState",
    "Decision",
    "Demand",
    "FirstFit",
    "InterconnectModel",
    "Job",
    "JobKind",
    "JobRecord",
    "JobRequest",
    "JobSpec",
    "JobState",
    "JobStore",
    "LocalBackend",
    "MachineCapacity",
    "NodeGroup",
    "Placement",
    "Placer",
    "Policy",
    "PolicyResult",
    "Preempt",
    "QueuePolicy",
    "RayBackend",
    "RayCommand",
    "Replace",
    "Resize",
    "SchedulingState",
    "SimConfig",
    "Start",
    "StragglerConfig",
    "StragglerDetector",
    "SyntheticTrace",
    "Topology",
    "TopologyAware",
    "Workload",
    "WorkloadKind",
    "assign_devices",
    "default_cluster_config",
    "detect_islands",
    "find_stragglers",
    "get_policy",
    "load_cluster",
    "load_trace",
    "mitigate",
    "parse_policies",
    "parse_topology_matrix",
    "plan_placement_group",
    "recognize",
    "save_trace",
    "simulate",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tether.scheduler' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
