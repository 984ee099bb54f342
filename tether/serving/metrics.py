"""Prometheus metrics of the engine server, on a registry of its own (no global state)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tether.engine.async_engine import AsyncEngine
from tether.engine.kv_tiers import KVTierStats


class RequestStatus(Enum):
    COMPLETED = "completed"
    ABORTED = "aborted"
    REJECTED = "rejected"
    OVERLOADED = "overloaded"
    FAILED = "failed"


class EngineCollector(Collector):
    """Gauges read from the engine thread's last published snapshot at scrape time."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        gauges: list[tuple[str, str, float]] = [
            ("tether_queue_depth", "Sequences waiting for a seat.", stats.num_waiting),
            ("tether_running_sequences", "Sequences holding KV blocks.", stats.num_running),
            ("tether_pending_requests", "Requests submitted and not finished.", self.engine.num_pending),
            ("tether_torch_threads", "Torch threads the engine steps with.", stats.torch_threads),
        ]
        if stats.blocks is not None:
            gauges += [
                (
                    "tether_kv_blocks_used",
                    "KV blocks referenced by a sequence.",
                    stats.blocks.num_used_blocks,
                ),
                ("tether_kv_blocks_total", "KV blocks in the cache.", stats.blocks.num_blocks),
                (
                    "tether_prefix_cache_hit_rate",
                    "Share of looked-up prompt tokens found in the prefix cache.",
                    stats.blocks.prefix_cache_hit_rate,
                ),
            ]
        counters: list[tuple[str, str, float]] = [
            (
                "tether_preemptions",
                "Sequences preempted (KV dropped, recomputed later).",
                stats.num_preemptions,
            ),
            (
                "tether_thread_changes",
                "Changes of the engine's thread count to follow the free cores (adapt_threads).",
                stats.thread_changes,
            ),
        ]
        if stats.weights is not None:
            weights = stats.weights
            gauges += [
                ("tether_policy_version", "Version of the weights in the model.", weights.policy_version),
                (
                    "tether_pending_weight_updates",
                    "Accepted weight updates waiting for earlier requests.",
                    weights.num_pending_updates,
                ),
            ]
            counters += [
                ("tether_weight_updates", "Weight updates applied.", weights.num_updates_applied),
                (
                    "tether_prefix_cache_invalidations",
                    "Prefix-cache invalidations (one per applied weight update).",
                    weights.num_prefix_cache_invalidations,
                ),
                (
                    "tether_retried_requests",
                    "Requests restarted from the prompt by a weight update.",
                    weights.num_retried_requests,
                ),
                (
                    "tether_recomputed_sequences",
                    "Sequences whose KV was recomputed under new weights.",
                    weights.num_recomputed_sequences,
                ),
            ]
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)
        for name, documentation, value in counters:
            yield CounterMetricFamily(name, documentation, value=value)
        if stats.tiers is not None:
            yield from _tier_metrics(stats.tiers)


def _tier_metrics(tiers: KVTierStats) -> Iterator[Metric]:
    """The KV tiers' counters (`engine/kv_tiers.py`), labelled by tier, direction and preemption mode."""
    hits = CounterMetricFamily(
        "tether_engine_kv_tier_hits",
        "Prompt tokens whose KV was found in a tier instead of computed (device: already in the cache).",
        labels=["tier"],
    )
    for tier, value in (
        ("device", tiers.device_hit_tokens),
        ("host", tiers.host_hit_tokens),
        ("disk", tiers.disk_hit_tokens),
    ):
        hits.add_metric([tier], value)
    moved = CounterMetricFamily(
        "tether_engine_kv_tier_bytes",
        "KV bytes moved into the device from a tier (in) and out of the device to a tier (out).",
        labels=["tier", "direction"],
    )
    for tier, direction, value in (
        ("host", "in", tiers.host_bytes_in),
        ("host", "out", tiers.host_bytes_out),
        ("disk", "in", tiers.disk_bytes_in),
        ("disk", "out", tiers.disk_bytes_out),
    ):
        moved.add_metric([tier, direction], value)
    preemptions = CounterMetricFamily(
        "tether_engine_preemptions", "Preemptions by what happened to the KV.", labels=["mode"]
    )
    preemptions.add_metric(["swap"], tiers.swap_preemptions)
    preemptions.add_metric(["recompute"], tiers.recompute_preemptions)
    yield hits
    yield moved
    yield CounterMetricFamily(
        "tether_engine_recomputed_tokens",
        "Tokens computed again although their KV had been computed (dropped, or cheaper to recompute).",
        value=tiers.recomputed_tokens,
    )
    yield preemptions
    yield GaugeMetricFamily(
        "tether_engine_kv_host_tier_blocks", "KV blocks held in the host tier.", value=tiers.host_blocks
    )
    yield GaugeMetricFamily(
        "tether_engine_kv_disk_tier_blocks", "KV blocks held in the disk tier.", value=tiers.disk_blocks
    )
    yield GaugeMetricFamily(
        "tether_engine_prefill_tokens_per_second",
        "Prefill rate the swap/restore cost model uses now (measured).",
        value=tiers.prefill_tokens_per_s,
    )


@dataclass(slots=True)
class ServerMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    generated_tokens: Counter = field(init=False)
    time_to_first_token: Histogram = field(init=False)
    time_per_output_token: Histogram = field(init=False)
    requests: Counter = field(init=False)

    def __post_init__(self) -> None:
        self.generated_tokens = Counter(
            "tether_generated_tokens", "Completion tokens generated.", registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "tether_time_to_first_token_seconds",
            "From request arrival to its first token.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "tether_time_per_output_token_seconds",
            "Mean time between a request's tokens after the first.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=self.registry,
        )
        self.requests = Counter(
            "tether_requests", "Requests by final status.", ["status"], registry=self.registry
        )
        for status in RequestStatus:
            self.requests.labels(status.value)
