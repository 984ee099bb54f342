"""Recall of older observations: ranking and bookkeeping, the real MiniLM encoder, and the runner's use."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from tests.agents.scripts import scripted, write_script
from tether.agents.memory import MiniLMEmbedder, ObservationMemory, Vectors
from tether.agents.runner import RunnerConfig, TaskRunner
from tether.agents.service import AgentsConfig, AgentStack
from tether.agents.task import ContextSpec, TaskSpec
from tether.chat import ChatRequest, Completion
from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec
from tether.store import TaskStatus
from tether.testing.scripted import ScriptedClient

VOCABULARY = ["password", "test", "file", "effect", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]


class WordCounts:
    """Stands in for the encoder where the test is about the memory's bookkeeping, not about semantics."""

    def __init__(self) -> None:
        self.embedded = 0

    def embed(self, texts: Sequence[str]) -> Vectors:
        self.embedded += len(texts)
        rows = (
            np.array([[text.count(word) for word in VOCABULARY] for text in texts], dtype=np.float32) + 1e-3
        )
        return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def test_memory_ranks_by_similarity_and_skips_keys_it_holds() -> None:
    embedder = WordCounts()
    memory = ObservationMemory(embedder)
    memory.add([("a", "password password"), ("b", "test test"), ("c", "file")])
    memory.add([("a", "password password"), ("d", "password file")])
    assert len(memory) == 4 and embedder.embedded == 4
    assert [r.key for r in memory.recall("password", 2)] == ["a", "d"]
    assert [r.key for r in memory.recall("password", 2, among={"b", "d"})] == ["d", "b"]
    assert memory.recall("password", 0) == []


@pytest.mark.slow
def test_the_bundled_minilm_encoder_finds_the_relevant_observation() -> None:
    memory = ObservationMemory(MiniLMEmbedder())
    memory.add(
        [
            ("a", "cat config.ini -> db_password = hunter2"),
            ("b", "python3 fizzbuzz.py -> 1 2 Fizz 4 Buzz"),
            ("c", "ls -> main.py notes.txt"),
            ("d", "pytest -> 3 passed in 0.02s"),
        ]
    )
    assert memory.recall("what is the database password?", 1)[0].key == "a"
    assert memory.recall("did the unit tests succeed", 1)[0].key == "d"


class Recording(ScriptedClient):
    def __init__(self, path: Path) -> None:
        super().__init__(scripted(path).replies)
        self.requests: list[ChatRequest] = []

    async def complete(self, request: ChatRequest) -> Completion:
        self.requests.append(request)
        return await super().complete(request)


async def test_a_long_task_is_shown_recalled_observations_after_the_recent_window(tmp_path: Path) -> None:
    stack = AgentStack(AgentsConfig.embedded(tmp_path / "agents"))
    model = Recording(write_script(tmp_path / "s.jsonl", steps=7))
    spec = TaskSpec(goal="g", context=ContextSpec(recent_steps=2, recall_k=2))
    task_id = await stack.submit(spec)
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1)) as pool:
        runner = TaskRunner(
            stack.journal, stack.artifacts, pool, model, "w", RunnerConfig(), embedder=WordCounts
        )
        assert await runner.run(task_id) is TaskStatus.SUCCEEDED
    await stack.close()
    early, late = model.requests[3], model.requests[6]
    assert not any("Possibly relevant" in str(m["content"]) for m in early.messages)  # nothing folded yet
    assert late.messages[:2] == early.messages[:2]  # the stable header
    recalled = late.messages[-1]["content"]
    assert recalled.startswith("Possibly relevant earlier observations:") and recalled.count("\n- ") == 2


def test_loading_the_encoder_draws_no_progress_bar_into_the_timeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    import transformers
    from transformers.utils import logging as transformers_logging

    class Loaded:
        def eval(self) -> Loaded:
            return self

    def load_with_a_bar(*args: object, **kwargs: object) -> Loaded:
        for _ in transformers_logging.tqdm(range(3), desc="Loading weights"):
            pass
        return Loaded()

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", load_with_a_bar)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: object())
    MiniLMEmbedder(tmp_path)
    assert "Loading weights" not in capfd.readouterr().err
    assert transformers_logging.is_progress_bar_enabled()  # the process's setting is left as it was
