"""The sandbox server's Prometheus metrics: run counts and latency, and the pool's own counters.

Each app owns its registry, so two servers in one process (tests) never share a counter.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tether.sandbox.pool import SandboxPool
from tether.sandbox.result import RunResult

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class PoolCollector(Collector):
    """Reads the pool's own counters at scrape time, so they can never drift from the pool."""

    def __init__(self, pool: SandboxPool) -> None:
        self.pool = pool

    def collect(self) -> Iterable[Metric]:
        pool = self.pool
        yield GaugeMetricFamily("tether_sandbox_queue_depth", "Runs waiting for a slot.", pool.queue_depth)
        yield GaugeMetricFamily(
            "tether_sandbox_busy_slots", "Slots running or holding a session.", pool.busy_slots
        )
        yield GaugeMetricFamily("tether_sandbox_slots", "Slots (workers) of the pool.", pool.config.slots)
        yield GaugeMetricFamily(
            "tether_sandbox_open_sessions", "Sessions open; each holds one slot.", len(pool.sessions)
        )
        yield CounterMetricFamily(
            "tether_sandbox_sessions_refused",
            "Session opens answered 503 because no slot freed up in time.",
            pool.sessions_refused,
        )
        yield GaugeMetricFamily(
            "tether_sandbox_warm_workers", "Started workers ready for a run now.", pool.warm_workers
        )
        yield CounterMetricFamily(
            "tether_sandbox_cold_starts",
            "Slots a queued run had to wait on a worker start for (see --warm-target).",
            pool.cold_starts,
        )
        yield CounterMetricFamily(
            "tether_sandbox_qc_failures", "Runs that failed the quality check.", pool.qc_failures
        )
        yield CounterMetricFamily(
            "tether_sandbox_workers_replaced", "Workers discarded and replaced.", pool.workers_replaced
        )


class ServerMetrics:
    def __init__(self, pool: SandboxPool) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.runs = Counter(
            "tether_sandbox_runs", "Runs served, by language and status.", ["language", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "tether_sandbox_run_seconds", "Run latency including queueing, by language.", ["language"],
            buckets=LATENCY_BUCKETS_S, registry=self.registry,
        )  # fmt: skip
        self.registry.register(PoolCollector(pool))

    def observe(self, language: str, result: RunResult, seconds: float) -> None:
        self.runs.labels(language, result.status.value).inc()
        self.latency.labels(language).observe(seconds)
