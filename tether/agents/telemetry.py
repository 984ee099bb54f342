"""Observability of agent steps: an OpenTelemetry span and a JSON log line per step and per tool call,
and Prometheus metrics (steps, tool latency, errors, tokens) in a registry owned by the caller.

Spans go to whatever tracer provider the process configured (none: OpenTelemetry's no-op); metrics live
in the `CollectorRegistry` passed in, so two workers in one process never share counters by accident.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Histogram

log = logging.getLogger("tether.agents")


class Telemetry:
    def __init__(self, registry: CollectorRegistry | None = None, tracer: trace.Tracer | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.tracer = tracer or trace.get_tracer("tether.agents")
        self.steps = Counter("tether_agent_steps", "Agent steps committed.", ["role"], registry=self.registry)
        self.tool_seconds = Histogram(
            "tether_agent_tool_seconds",
            "Tool call latency in seconds.",
            ["tool"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120),
            registry=self.registry,
        )
        self.model_seconds = Histogram(
            "tether_agent_model_seconds", "Model call latency in seconds.", registry=self.registry
        )
        self.errors = Counter("tether_agent_errors", "Failures by kind.", ["kind"], registry=self.registry)
        self.tokens = Counter("tether_agent_tokens", "Model tokens.", ["kind"], registry=self.registry)

    @contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[trace.Span]:
        with self.tracer.start_as_current_span(name) as span:
            for key, value in attributes.items():
                span.set_attribute(f"tether.{key}", value)
            yield span

    def event(self, kind: str, **fields: Any) -> None:
        """One structured log line: machine-readable JSON with a stable `event` key."""
        log.info(json.dumps({"event": kind, "ts": round(time.time(), 3), **fields}, default=str))

    def step_committed(
        self, task_id: str, step_no: int, role: str, usage: dict[str, Any], seconds: float
    ) -> None:
        self.steps.labels(role=role).inc()
        for kind in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            self.tokens.labels(kind=kind).inc(int(usage.get(kind, 0)))
        self.event(
            "step", task_id=task_id, step_no=step_no, role=role, usage=usage, seconds=round(seconds, 4)
        )

    def tool_finished(self, task_id: str, step_no: int, tool: str, seconds: float, error: bool) -> None:
        self.tool_seconds.labels(tool=tool).observe(seconds)
        if error:
            self.errors.labels(kind="tool").inc()
        self.event(
            "tool", task_id=task_id, step_no=step_no, tool=tool, seconds=round(seconds, 4), error=error
        )
