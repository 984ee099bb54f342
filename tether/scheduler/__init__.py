"""The scheduler: one priority queue for mixed jobs, placement, preemption, stragglers, and a simulator."""

from tether.scheduler.cluster import (
    ClusterConfig,
    ClusterState,
    NodeGroup,
    Placement,
    Topology,
    default_cluster_config,
    load_cluster,
)
from tether.scheduler.job import Demand, Job, JobKind, JobSpec, JobState
from tether.scheduler.local import LocalBackend, MachineCapacity
from tether.scheduler.placement import FirstFit, InterconnectModel, Placer, TopologyAware
from tether.scheduler.policy import POLICIES, Policy, QueuePolicy, get_policy, parse_policies
from tether.scheduler.ray_backend import RayBackend, plan_placement_group
from tether.scheduler.simulator import PolicyResult, SimConfig, simulate
from tether.scheduler.state import Decision, Preempt, Replace, Resize, SchedulingState, Start
from tether.scheduler.store import JobRecord, JobRequest, JobStore
from tether.scheduler.straggler import StragglerConfig, StragglerDetector, find_stragglers, mitigate
from tether.scheduler.trace import SyntheticTrace, load_trace, save_trace

__all__ = [
    "POLICIES",
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
    "default_cluster_config",
    "find_stragglers",
    "get_policy",
    "load_cluster",
    "load_trace",
    "mitigate",
    "parse_policies",
    "plan_placement_group",
    "save_trace",
    "simulate",
]
