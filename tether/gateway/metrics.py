"""The gateway's Prometheus metrics, in one registry per gateway app (no global state)."""

from __future__ import annotations

from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Labelled(Generic[M]):
    """A metric's children by label values, each looked up in prometheus once: `labels()` validates and
    locks on every call, which the request path would otherwise pay several times per request."""

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tether_gateway_requests", "Requests by tier and HTTP status.", ["tier", "status"], registry=r
        )
        self.latency = Histogram(
            "tether_gateway_request_latency_seconds",
            "Time from arrival to the last byte.",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "tether_gateway_time_to_first_token_seconds",
            "Time from arrival to the first streamed content chunk.",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "tether_gateway_errors", "Refused or failed requests by error code.", ["code"], registry=r
        )
        self.tokens = Counter(
            "tether_gateway_tokens",
            "Tokens by tenant, tier and kind.",
            ["tenant", "tier", "kind"],
            registry=r,
        )
        self.cost = Counter(
            "tether_gateway_cost_usd", "Billed USD by tenant and tier.", ["tenant", "tier"], registry=r
        )
        self.queue_depth = Gauge(
            "tether_gateway_queue_depth", "Requests waiting for a pool.", ["pool"], registry=r
        )
        self.in_flight = Gauge(
            "tether_gateway_in_flight", "Requests running in a pool.", ["pool"], registry=r
        )
        self.replica_up = Gauge(
            "tether_gateway_replica_up",
            "1 while a pool's replica passes its health checks, else 0.",
            ["pool", "replica"],
            registry=r,
        )
        self.replica_in_flight = Gauge(
            "tether_gateway_replica_in_flight",
            "Requests running on a pool's replica.",
            ["pool", "replica"],
            registry=r,
        )
        self.routed = Counter(
            "tether_gateway_routed",
            "Requests sent to a replica, by why it was chosen (prefix, spill, least_loaded, round_robin, "
            "failover).",
            ["pool", "by"],
            registry=r,
        )
        self.retries = Counter(
            "tether_gateway_retries",
            "Requests sent again to another replica before any byte reached the client, by the reason.",
            ["pool", "reason"],
            registry=r,
        )
        self.requests_by = Labelled(self.requests)
        self.latency_by = Labelled(self.latency)
        self.ttft_by = Labelled(self.ttft)
        self.errors_by = Labelled(self.errors)
        self.tokens_by = Labelled(self.tokens)
        self.cost_by = Labelled(self.cost)
        self.replica_up_by = Labelled(self.replica_up)
        self.replica_in_flight_by = Labelled(self.replica_in_flight)
        self.routed_by = Labelled(self.routed)
        self.retries_by = Labelled(self.retries)
