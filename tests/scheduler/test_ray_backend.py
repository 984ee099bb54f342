"""The Ray back end: placements translated into pinned placement-group bundles, with a fake and a real Ray."""

from __future__ import annotations

import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tether.scheduler.cluster import Placement
from tether.scheduler.job import Demand, Job, JobSpec
from tether.scheduler.policy import get_policy
from tether.scheduler.ray_backend import RayBackend, RayCommand, plan_placement_group, topology_from_ray_nodes
from tether.scheduler.state import Preempt, Start
from tether.scheduler.workload import TETHER, WorkloadKind

GIB = 1024**3
RAY_NODES = [
    {
        "NodeID": "a",
        "Alive": True,
        "NodeManagerAddress": "10.0.0.1",
        "Resources": {"CPU": 32.0, "GPU": 8.0, "memory": 256 * GIB},
    },
    {
        "NodeID": "dead",
        "Alive": False,
        "NodeManagerAddress": "10.0.0.9",
        "Resources": {"CPU": 32.0, "GPU": 8.0},
    },
    {
        "NodeID": "b",
        "Alive": True,
        "NodeManagerAddress": "10.0.0.2",
        "Resources": {"CPU": 32.0, "GPU": 8.0, "memory": 256 * GIB},
    },
]


class FakeRay:
    """Stands in for the `ray` module: live nodes, and a record of placement-group calls."""

    def __init__(self) -> None:
        self.created: list[tuple[list[dict[str, float]], str, str]] = []
        self.removed: list[str] = []
        self.util = types.SimpleNamespace(placement_group=self._create, remove_placement_group=self._remove)

    def nodes(self) -> list[dict[str, Any]]:
        return RAY_NODES

    def _create(self, bundles: list[dict[str, float]], strategy: str, name: str) -> str:
        self.created.append((bundles, strategy, name))
        return name

    def _remove(self, group: str) -> None:
        self.removed.append(group)


def test_live_ray_nodes_become_one_island_each() -> None:
    topology, addresses = topology_from_ray_nodes(RAY_NODES)
    assert addresses == ["10.0.0.1", "10.0.0.2"]
    assert [(n.accelerators, n.cpus, n.memory_mib) for n in topology.nodes] == [(8, 32.0, 262144)] * 2
    assert topology.island_nodes == ((0,), (1,)) and topology.rack_nodes == ((0, 1),)


def test_a_cluster_without_live_nodes_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no live nodes"):
        topology_from_ray_nodes([RAY_NODES[1]])


def test_a_single_node_gang_is_strict_pack_with_pinned_bundles() -> None:
    demand = Demand(accelerators=1, cpus=4, memory_mib=1024)
    plan = plan_placement_group("job1", Placement(demand, ((1, 2),)), ["10.0.0.1", "10.0.0.2"])
    bundle = {"node:10.0.0.2": 0.001, "CPU": 4.0, "GPU": 1.0, "memory": 1024 * 1024 * 1024.0}
    assert (plan.name, plan.strategy, plan.bundles) == ("tether-job1", "STRICT_PACK", (bundle, bundle))


def test_a_multi_node_gang_is_pack_with_each_replica_on_its_node() -> None:
    demand = Demand(accelerators=0, cpus=2, memory_mib=0)
    plan = plan_placement_group("job2", Placement(demand, ((0, 1), (1, 2))), ["10.0.0.1", "10.0.0.2"])
    assert plan.strategy == "PACK"
    assert [sorted(b) for b in plan.bundles] == [
        ["CPU", "node:10.0.0.1"],
        ["CPU", "node:10.0.0.2"],
        ["CPU", "node:10.0.0.2"],
    ]


def test_the_backend_creates_and_removes_groups_as_the_policy_decides() -> None:
    ray = FakeRay()
    backend = RayBackend(get_policy("priority"), ray=ray)
    gpu = Demand(accelerators=1, cpus=1, memory_mib=0)
    backend.state.submit(Job(JobSpec("low", gpu, replicas=16, priority=0)))
    assert [type(d) for d in backend.schedule(0.0)] == [Start]
    assert ray.created[0][1] == "PACK" and len(ray.created[0][0]) == 16
    backend.state.submit(Job(JobSpec("urgent", gpu, replicas=8, priority=3)))
    assert [type(d) for d in backend.schedule(1.0)] == [Preempt, Start]
    assert ray.removed == ["tether-low"]
    assert ray.created[1][1:] == ("STRICT_PACK", "tether-urgent")
    backend.finish("urgent", 2.0)
    assert ray.removed == ["tether-low", "tether-urgent"]


@pytest.mark.slow
def test_a_real_local_ray_reserves_the_planned_group() -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        backend = RayBackend(get_policy("topology"))
        backend.state.submit(
            Job(JobSpec("gang", Demand(accelerators=0, cpus=0.5, memory_mib=64), replicas=2))
        )
        assert [type(d) for d in backend.schedule(0.0)] == [Start]
        group = backend.groups["gang"]
        ray.get(group.ready(), timeout=30)
        table = ray.util.placement_group_table(group)
        assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 2
        backend.finish("gang", 1.0)
    finally:
        ray.shutdown()


class FakeLauncher:
    """Replicas that run until told to exit: records what was started and stopped."""

    def __init__(self) -> None:
        self.started: list[tuple[str, int, tuple[str, ...]]] = []
        self.stopped: list[tuple[str, int, float]] = []
        self.exit_codes: dict[tuple[str, int], int] = {}

    def start(self, group: Any, bundle: int, demand: Demand, command: Sequence[str]) -> tuple[str, int]:
        self.started.append((group, bundle, tuple(command)))
        return (group, bundle)

    def poll(self, handle: tuple[str, int]) -> int | None:
        return self.exit_codes.get(handle)

    def devices(self, handle: tuple[str, int]) -> str:
        return str(handle[1])

    def stop(self, handle: tuple[str, int], grace_s: float) -> None:
        self.stopped.append((*handle, grace_s))


def test_jobs_run_one_replica_per_bundle_and_a_preempted_train_job_resumes(tmp_path: Path) -> None:
    launcher = FakeLauncher()
    backend = RayBackend(get_policy("priority"), ray=FakeRay(), launcher=launcher)
    gpu = Demand(accelerators=8, cpus=1, memory_mib=0)
    run_dir = tmp_path / "runs" / "low"
    train = RayCommand(("tether", "train", "--config", "low.toml"), WorkloadKind.TRAIN, str(run_dir), 60.0)
    backend.submit(JobSpec("low", gpu, replicas=1, priority=0), train)
    backend.submit(JobSpec("gang", gpu, replicas=1), RayCommand(("python", "work.py")))
    backend.schedule(0.0)
    assert [s[1:] for s in launcher.started] == [
        (0, (*TETHER, "train", "--config", "low.toml")),
        (0, ("python", "work.py")),
    ]
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step-000002")
    backend.submit(
        JobSpec("urgent", Demand(accelerators=8, cpus=1, memory_mib=0), priority=5), RayCommand(("x",))
    )
    backend.schedule(1.0)
    assert launcher.stopped == [("tether-low", 0, 60.0)]  # the train job's grace: time to checkpoint
    launcher.exit_codes[("tether-urgent", 0)] = 0
    assert backend.devices("low") == [] and backend.devices("urgent") == ["0"]
    assert backend.poll(2.0) == {"urgent": 0}
    backend.schedule(3.0)
    assert launcher.started[-1] == ("tether-low", 0, (*TETHER, "train", "--resume", str(run_dir)))
    launcher.exit_codes[("tether-gang", 0)] = 3
    assert backend.poll(4.0) == {"gang": 3}
    assert backend.state.running.keys() == {"low"}
    backend.cancel("low", 5.0)
    assert launcher.stopped[-1] == ("tether-low", 0, 60.0) and not backend.state.running
    with pytest.raises(ValueError, match="no queued or running job 'low'"):
        backend.cancel("low", 6.0)


@pytest.mark.slow
def test_a_real_local_ray_runs_each_job_on_its_own_gpu_and_preemption_stops_it(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        backend = RayBackend(get_policy("priority"))
        demand = Demand(accelerators=1, cpus=0.5, memory_mib=64)
        for name in ("a", "b"):
            script = f"echo $CUDA_VISIBLE_DEVICES > {tmp_path / name}; exec sleep 60"
            backend.submit(
                JobSpec(name, demand, preemptible=True), RayCommand(("sh", "-c", script), stop_grace_s=5)
            )
        backend.schedule(0.0)
        deadline = time.monotonic() + 60
        while not all((tmp_path / n).exists() for n in "ab") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sorted((tmp_path / n).read_text().strip() for n in "ab") == ["0", "1"]
        assert sorted(backend.devices("a") + backend.devices("b")) == ["0", "1"]
        urgent = f"echo $CUDA_VISIBLE_DEVICES > {tmp_path / 'urgent'}"
        backend.submit(JobSpec("urgent", demand, priority=5), RayCommand(("sh", "-c", urgent)))
        assert [type(d) for d in backend.schedule(1.0)] == [Preempt, Start]
        while not backend.poll(2.0) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert backend.exits == {"urgent": 0}
        assert (tmp_path / "urgent").read_text().strip() in ("0", "1")
    finally:
        ray.shutdown()
