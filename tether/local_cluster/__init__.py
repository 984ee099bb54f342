"""A local cluster in one command: sandbox servers, engine replicas, the gateway and agent workers as
`tether` processes on this machine, supervised, with their state on disk for `tether up status` and
`tether down`. Spawns only `tether` subprocesses and imports nothing of the pieces it runs."""

from tether.local_cluster.config import ClusterFile, load_cluster_file, parse_cluster_file
from tether.local_cluster.plan import ClusterPlan, PieceKind, PieceSpec, Service, ServiceKind, plan_cluster
from tether.local_cluster.state import ClusterState, Phase, PieceStatus

__all__ = [
    "ClusterFile",
    "ClusterPlan",
    "ClusterState",
    "Phase",
    "PieceKind",
    "PieceSpec",
    "PieceStatus",
    "Service",
    "ServiceKind",
    "load_cluster_file",
    "parse_cluster_file",
    "plan_cluster",
]
