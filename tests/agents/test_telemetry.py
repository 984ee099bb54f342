"""Every step emits spans (model call, step, each tool call), a JSON log line and Prometheus metrics."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest

from tests.agents.scripts import scripted, write_script
from tether.agents.runner import RunnerConfig, TaskRunner
from tether.agents.service import AgentsConfig, AgentStack
from tether.agents.task import TaskSpec
from tether.agents.telemetry import Telemetry
from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec
from tether.store import TaskStatus


async def test_a_run_is_traced_logged_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = Telemetry(tracer=provider.get_tracer("test"))
    stack = AgentStack(AgentsConfig.embedded(tmp_path / "agents"))
    task_id = await stack.submit(TaskSpec(goal="g"))
    caplog.set_level(logging.INFO, logger="tether.agents")
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1)) as pool:
        model = scripted(write_script(tmp_path / "s.jsonl", steps=2))
        runner = TaskRunner(
            stack.journal, stack.artifacts, pool, model, "w", RunnerConfig(), telemetry=telemetry
        )
        assert await runner.run(task_id) is TaskStatus.SUCCEEDED
    await stack.close()

    names = [span.name for span in exporter.get_finished_spans()]
    assert names.count("agent.model") == 3 and names.count("agent.step") == 3
    assert names.count("agent.tool") == 5  # bash + write_file twice, then finish
    tool_span = next(span for span in exporter.get_finished_spans() if span.name == "agent.tool")
    assert tool_span.attributes is not None and tool_span.attributes["tether.key"] == f"{task_id}:0:0"

    events = [json.loads(record.getMessage()) for record in caplog.records if record.name == "tether.agents"]
    assert [e["step_no"] for e in events if e["event"] == "step"] == [0, 1, 2]
    assert events[-1] == {
        "event": "task",
        "ts": events[-1]["ts"],
        "task_id": task_id,
        "status": "succeeded",
        "error": None,
    }

    metrics = generate_latest(telemetry.registry).decode()
    assert 'tether_agent_steps_total{role="agent"} 3.0' in metrics
    assert 'tether_agent_tool_seconds_count{tool="shell"} 2.0' in metrics
    assert 'tether_agent_tokens_total{kind="prompt_tokens"}' in metrics
