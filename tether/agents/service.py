"""Where agent state lives and how a task enters it: the URLs of journal, bus and artifacts, and `submit`.

`AgentsConfig` is the one place those locations are decided (CLI flags fill it); `AgentStack` opens them
together and closes them together.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from tether.agents.task import TaskSpec
from tether.bus.base import BusConfig, TaskBus
from tether.bus.factory import open_bus
from tether.store.artifacts import ArtifactStore
from tether.store.journal import Journal


@dataclass(frozen=True, slots=True)
class AgentsConfig:
    store_url: str  # sqlite:///PATH or postgresql://...
    bus_url: str  # sqlite:///PATH, redis://... or nats://...
    artifacts_url: str  # a directory or an fsspec URL
    bus_name: str = "tether-tasks"
    table_prefix: str = "agent_"
    visibility_timeout_s: float = 30.0
    lease_s: float = 30.0

    @classmethod
    def embedded(cls, root: Path) -> AgentsConfig:
        """Everything in one directory: SQLite journal and queue, artifacts on the local filesystem."""
        return cls(
            store_url=f"sqlite:///{root / 'journal.db'}",
            bus_url=f"sqlite:///{root / 'queue.db'}",
            artifacts_url=str(root / "artifacts"),
        )

    @property
    def bus(self) -> BusConfig:
        return BusConfig(self.bus_url, name=self.bus_name, visibility_timeout_s=self.visibility_timeout_s)


class AgentStack:
    def __init__(self, config: AgentsConfig) -> None:
        self.config = config
        self.journal = Journal(config.store_url, table_prefix=config.table_prefix)
        self.bus: TaskBus = open_bus(config.bus)
        self.artifacts = ArtifactStore(config.artifacts_url)

    async def submit(self, spec: TaskSpec, task_id: str | None = None) -> str:
        """Journal the task first, then enqueue it; a crash between the two is healed by `resume`."""
        task_id = task_id or f"t-{uuid.uuid4().hex[:16]}"
        self.journal.create_task(task_id, spec.model_dump(mode="json"))
        await self.bus.publish(task_id)
        return task_id

    async def resume(self, task_id: str) -> None:
        """Requeue a task that stopped (failed, cancelled, or lost its queue message); it keeps its steps."""
        self.journal.requeue(task_id)
        await self.bus.publish(task_id)

    async def close(self) -> None:
        await self.bus.close()
        self.journal.close()
