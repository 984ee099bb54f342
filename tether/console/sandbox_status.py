"""What the sandboxes page shows of each `tether sandbox serve`: read from its `/metrics` (Prometheus
text), `/v1/load` (its instance name) and `/v1/recent-failures`, never from the pool itself.

`parse_figures` and `quantile` are pure; `SandboxWatch` does the I/O, with a short timeout, and keeps each
server's previous scrape so that runs per second come from the counters' deltas. A server that does not
answer is reported down with the reason, never raised.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tether.sandbox.failures import RecentFailure

SCRAPE_TIMEOUT_S = 2.0
FAILURES_SHOWN = 20
RATE_WINDOW_S = 1.0


@dataclass(frozen=True, slots=True)
class SandboxFigures:
    """One scrape of `/metrics`: totals since the server started, and its gauges now."""

    runs: float = 0.0
    runs_by_status: dict[str, float] = field(default_factory=dict)
    slots: int = 0
    busy_slots: int = 0
    queue_depth: int = 0
    open_sessions: int = 0
    warm_workers: int = 0
    qc_failures: float = 0.0
    workers_replaced: float = 0.0
    # Cumulative (upper bound in seconds, runs at or under it), summed over languages, ascending.
    latency_buckets: tuple[tuple[float, float], ...] = ()

    @property
    def free_slots(self) -> int:
        return max(self.slots - self.busy_slots, 0)


def quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of a cumulative histogram, interpolated inside its bucket as Prometheus'
    `histogram_quantile` does; None without observations. Beyond the last finite bound it is that bound."""
    assert 0 <= q <= 1
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            inside = count - lower_count
            share = (rank - lower_count) / inside if inside > 0 else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def _sum_buckets(samples: Iterable[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    summed: dict[float, float] = {}
    for bound, count in samples:
        summed[bound] = summed.get(bound, 0.0) + count
    return tuple(sorted(summed.items()))


def parse_figures(text: str) -> SandboxFigures:
    """The figures of a sandbox server's `/metrics`; metrics it does not expose stay 0. Raises ValueError
    on text that is not Prometheus' exposition format."""
    gauges: dict[str, float] = {}
    by_status: dict[str, float] = {}
    buckets: list[tuple[float, float]] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tether_sandbox_runs_total":
                status = sample.labels.get("status", "")
                by_status[status] = by_status.get(status, 0.0) + sample.value
            elif sample.name == "tether_sandbox_run_seconds_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name.startswith("tether_sandbox_") and not sample.name.endswith("_created"):
                gauges[sample.name.removeprefix("tether_sandbox_").removesuffix("_total")] = sample.value
    return SandboxFigures(
        runs=sum(by_status.values()),
        runs_by_status=by_status,
        slots=int(gauges.get("slots", 0)),
        busy_slots=int(gauges.get("busy_slots", 0)),
        queue_depth=int(gauges.get("queue_depth", 0)),
        open_sessions=int(gauges.get("open_sessions", 0)),
        warm_workers=int(gauges.get("warm_workers", 0)),
        qc_failures=gauges.get("qc_failures", 0.0),
        workers_replaced=gauges.get("workers_replaced", 0.0),
        latency_buckets=_sum_buckets(buckets),
    )


@dataclass(frozen=True, slots=True)
class SandboxStatus:
    """One server as the page shows it. `figures` is None when it is down (`problem` says why)."""

    url: str
    instance: str
    scraped_at: float
    figures: SandboxFigures | None = None
    problem: str | None = None
    runs_per_s: float | None = None
    p50_s: float | None = None
    p99_s: float | None = None
    failures: tuple[RecentFailure, ...] = ()

    @property
    def up(self) -> bool:
        return self.figures is not None

    def summary(self) -> dict[str, object]:
        figures = self.figures
        return {
            "url": self.url,
            "instance": self.instance,
            "up": self.up,
            "problem": self.problem,
            "scraped_at": self.scraped_at,
            "slots": figures.slots if figures else None,
            "busy_slots": figures.busy_slots if figures else None,
            "free_slots": figures.free_slots if figures else None,
            "queue_depth": figures.queue_depth if figures else None,
            "open_sessions": figures.open_sessions if figures else None,
            "runs": figures.runs if figures else None,
            "runs_by_status": figures.runs_by_status if figures else {},
            "runs_per_s": self.runs_per_s,
            "p50_s": self.p50_s,
            "p99_s": self.p99_s,
            "qc_failures": figures.qc_failures if figures else None,
            "workers_replaced": figures.workers_replaced if figures else None,
            "recent_failures": [failure.model_dump(mode="json") for failure in self.failures],
        }


@dataclass
class SandboxWatch:
    """Scrapes the console's sandbox servers; remembers each one's last good scrape for its rates."""

    urls: tuple[str, ...]
    client: httpx.AsyncClient
    clock: Callable[[], float] = time.time
    _previous: dict[str, tuple[float, SandboxFigures]] = field(default_factory=dict)

    async def statuses(self) -> list[SandboxStatus]:
        return list(await asyncio.gather(*(self.status(url) for url in self.urls)))

    async def status(self, url: str) -> SandboxStatus:
        base = url.rstrip("/")
        now = self.clock()
        down = SandboxStatus(url=base, instance=base, scraped_at=now)
        try:
            metrics, load, failures = await asyncio.gather(
                self.client.get(f"{base}/metrics", timeout=SCRAPE_TIMEOUT_S),
                self.client.get(f"{base}/v1/load", timeout=SCRAPE_TIMEOUT_S),
                self.client.get(
                    f"{base}/v1/recent-failures", params={"limit": FAILURES_SHOWN}, timeout=SCRAPE_TIMEOUT_S
                ),
            )
        except httpx.HTTPError as error:
            return replace(down, problem=f"no answer ({type(error).__name__}: {error or 'timed out'})")
        if metrics.status_code != 200:
            return replace(down, problem=f"/metrics answered HTTP {metrics.status_code}")
        try:
            figures = parse_figures(metrics.text)
        except (ValueError, KeyError) as error:
            return replace(down, problem=f"/metrics is not Prometheus text ({error})")
        return SandboxStatus(
            url=base,
            instance=_instance(load) or base,
            scraped_at=now,
            figures=figures,
            runs_per_s=self._rate(base, now, figures),
            p50_s=quantile(figures.latency_buckets, 0.5),
            p99_s=quantile(figures.latency_buckets, 0.99),
            failures=_failures(failures),
        )

    def _rate(self, url: str, now: float, figures: SandboxFigures) -> float | None:
        previous = self._previous.get(url)
        if previous is None or figures.runs < previous[1].runs:
            # the first scrape, or the server restarted (its counters began again)
            self._previous[url] = (now, figures)
            return None
        before, then = previous
        if now - before >= RATE_WINDOW_S:
            # several pages polling at once would otherwise measure over a few milliseconds
            self._previous[url] = (now, figures)
        return (figures.runs - then.runs) / (now - before) if now > before else None


def _instance(load: httpx.Response) -> str | None:
    if load.status_code != 200:
        return None
    try:
        name = load.json().get("instance")
    except (ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name else None


def _failures(answer: httpx.Response) -> tuple[RecentFailure, ...]:
    """The server's recent failures; none from a server that predates the endpoint or answers oddly."""
    if answer.status_code != 200:
        return ()
    try:
        listed = answer.json()["failures"]
        return tuple(RecentFailure.model_validate(item) for item in listed)
    except (ValueError, KeyError, TypeError):
        return ()
