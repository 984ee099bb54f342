"""`Recaller`: the older observations a runner's next step is reminded of, one memory per task.

The encoder is loaded on first use (only long tasks need it) and runs off the event loop; the memories
are derived state, rebuilt from the journal on resume and dropped when the task's run ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tether.agents.context import folded_count, recall_items, recall_query
from tether.agents.memory import Embedder, ObservationMemory
from tether.agents.task import TaskSpec
from tether.store.records import StepRecord


class Recaller:
    def __init__(self, embedder: Callable[[], Embedder] | None) -> None:
        self._embedder_factory = embedder
        self._embedder: Embedder | None = None
        self._memories: dict[str, ObservationMemory] = {}
        self._embedder_lock = asyncio.Lock()

    async def recall(self, spec: TaskSpec, steps: list[StepRecord]) -> list[str]:
        """Texts of the observations of folded steps nearest to the newest step; candidates are the
        steps the count rule folds, so none of them is also shown verbatim whatever the budget folds."""
        folded = folded_count(len(steps), spec.context.recent_steps)
        if not folded or not spec.context.recall_k or self._embedder_factory is None:
            return []
        # Loading and running the encoder take seconds of CPU: off the event loop, so the lease keeper
        # and the other tasks of this worker keep running meanwhile.
        async with self._embedder_lock:  # two tasks reaching this at once load the encoder once
            if self._embedder is None:
                self._embedder = await asyncio.to_thread(self._embedder_factory)
        memory = self._memories.setdefault(steps[0].task_id, ObservationMemory(self._embedder))
        items = recall_items(steps[:folded], spec.context.summary_chars * 2)
        query = recall_query(steps, spec.context.observation_chars)

        def search() -> list[str]:
            memory.add(items)
            found = memory.recall(query, spec.context.recall_k, among={key for key, _ in items})
            return [item.text for item in found]

        return await asyncio.to_thread(search)

    def forget(self, task_id: str) -> None:
        self._memories.pop(task_id, None)
