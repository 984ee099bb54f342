"""The acceptance fault test: tasks run by real worker processes that are SIGKILLed at random.

Every task must complete, every step must be in the journal exactly once, no side-effecting call may
take effect twice, and every task's final workdir must equal an uninterrupted run's. The default-run
version is small; the full size (20 tasks x 30+ steps x 3 workers, every back end) is marked slow.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.agents.chaos import WorkerFleet, assert_exactly_once, run_with_chaos, snapshot_files
from tests.agents.scripts import expected_effects, scripted, write_script
from tests.store.backends import POSTGRES_URL, skip_without_services
from tether.agents.runner import RunnerConfig, TaskRunner
from tether.agents.service import AgentsConfig, AgentStack
from tether.agents.task import ContextSpec, Limits, TaskSpec
from tether.bus import open_bus
from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec
from tether.store import TaskStatus

LEASE_S = 2.0


@dataclass(frozen=True)
class Scale:
    tasks: int
    steps: int
    workers: int
    kill_every_s: float
    timeout_s: float


SMALL = Scale(tasks=4, steps=14, workers=3, kill_every_s=1.0, timeout_s=150)
FULL = Scale(tasks=20, steps=32, workers=3, kill_every_s=4.0, timeout_s=1500)

BACKENDS = {
    "sqlite+embedded": ("sqlite", "sqlite"),
    "postgres+nats": ("postgres", "nats://127.0.0.1:4222"),
    "postgres+redis": ("postgres", "redis://127.0.0.1:6379/0"),
}


def stack_config(backend: str, tmp_path: Path) -> AgentsConfig:
    store, bus = BACKENDS[backend]
    if store != "sqlite":
        skip_without_services()
    embedded = AgentsConfig.embedded(tmp_path / "agents")
    return AgentsConfig(
        store_url=embedded.store_url if store == "sqlite" else POSTGRES_URL,
        bus_url=embedded.bus_url if bus == "sqlite" else bus,
        artifacts_url=embedded.artifacts_url,
        bus_name=f"chaos-{uuid.uuid4().hex[:10]}",
        table_prefix=f"chaos{uuid.uuid4().hex[:8]}_",
        visibility_timeout_s=LEASE_S,
        lease_s=LEASE_S,
    )


def task_spec(steps: int) -> TaskSpec:
    # Retrieval is off: this test is about durability, and each restarted worker would reload the encoder.
    return TaskSpec(
        goal="append effects",
        limits=Limits(max_steps=steps + 5),
        context=ContextSpec(recall_k=0),
        sandbox=SandboxSpec(timeout_s=20),
    )


async def uninterrupted_files(script: Path, steps: int, root: Path) -> dict[str, bytes]:
    stack = AgentStack(AgentsConfig.embedded(root))
    try:
        task_id = await stack.submit(task_spec(steps))
        async with SandboxPool(SandboxSpec(timeout_s=20), PoolConfig(slots=1)) as pool:
            runner = TaskRunner(
                stack.journal,
                stack.artifacts,
                pool,
                scripted(script),
                "reference",
                RunnerConfig(),
            )
            assert await runner.run(task_id) is TaskStatus.SUCCEEDED
        return snapshot_files(stack.artifacts, stack.journal.steps(task_id)[-1].snapshot_key)
    finally:
        await stack.close()


def run_chaos(backend: str, scale: Scale, tmp_path: Path) -> dict[str, object]:
    config = stack_config(backend, tmp_path)
    script = write_script(tmp_path / "script.jsonl", scale.steps)
    reference = asyncio.run(uninterrupted_files(script, scale.steps, tmp_path / "reference"))
    assert reference["effects.log"].decode() == expected_effects(scale.steps)

    async def submit_all() -> list[str]:
        stack = AgentStack(config)
        try:
            return [await stack.submit(task_spec(scale.steps)) for _ in range(scale.tasks)]
        finally:
            await stack.close()

    task_ids = asyncio.run(submit_all())
    args = [
        "--store", config.store_url, "--bus", config.bus_url, "--bus-name", config.bus_name,
        "--table-prefix", config.table_prefix, "--artifacts", config.artifacts_url,
        "--model", f"scripted:{script}", "--max-in-flight", "2",
        "--visibility-timeout-s", str(LEASE_S), "--lease-s", str(LEASE_S),
    ]  # fmt: skip
    (tmp_path / "logs").mkdir()
    fleet = WorkerFleet(args, tmp_path / "logs", scale.workers)
    stack = AgentStack(config)
    asyncio.run(stack.bus.close())  # only the journal and artifacts are used from this thread
    try:
        seconds = run_with_chaos(stack.journal, task_ids, fleet, scale.kill_every_s, scale.timeout_s)
        summary = assert_exactly_once(stack.journal, task_ids, scale.steps)
        for task_id in task_ids:
            final = stack.journal.steps(task_id)[-1]
            assert snapshot_files(stack.artifacts, final.snapshot_key) == reference, task_id
        assert asyncio.run(_depth_then_destroy(config, destroy=False)) == 0
    finally:
        if config.store_url.startswith("postgresql"):
            stack.journal.drop_schema()
        stack.journal.close()
        asyncio.run(_depth_then_destroy(config, destroy=True))
    assert fleet.kills >= 1, "the chaos loop never killed a worker; the test proved nothing"
    return {**summary, "kills": fleet.kills, "seconds": round(seconds, 1)}


async def _depth_then_destroy(config: AgentsConfig, destroy: bool) -> int:
    """Each asyncio.run needs its own bus client: network clients are bound to the loop that made them."""
    bus = open_bus(config.bus)
    try:
        depth = await bus.depth()
        if destroy:
            await bus.destroy()
        return depth
    finally:
        await bus.close()


@pytest.mark.parametrize(
    "backend", ["sqlite+embedded", pytest.param("postgres+nats", marks=pytest.mark.services)]
)
def test_tasks_survive_workers_killed_at_random(backend: str, tmp_path: Path) -> None:
    result = run_chaos(backend, SMALL, tmp_path)
    print(f"chaos {backend} {SMALL}: {result}")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    "backend",
    [
        "sqlite+embedded",
        pytest.param("postgres+nats", marks=pytest.mark.services),
        pytest.param("postgres+redis", marks=pytest.mark.services),
    ],
)
def test_full_size_fault_acceptance(backend: str, tmp_path: Path) -> None:
    result = run_chaos(backend, FULL, tmp_path)
    print(f"chaos {backend} {FULL}: {result}")
