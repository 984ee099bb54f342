"""Turning simulation results into the comparison JSON and the utilization / queue-length plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tether.scheduler.simulator import PolicyResult

PLOT_POINTS = 2000


def jct_ratio(results: dict[str, PolicyResult], policy: str, baseline: str) -> float | None:
    """Average JCT of `policy` over that of `baseline`; None unless both ran."""
    if policy not in results or baseline not in results or results[baseline].avg_jct_s == 0:
        return None
    return round(results[policy].avg_jct_s / results[baseline].avg_jct_s, 4)


def comparison(results: dict[str, PolicyResult], context: dict[str, Any]) -> dict[str, Any]:
    return {
        **context,
        "policies": {name: result.summary() for name, result in results.items()},
        "jct_ratio_topology_vs_fifo": jct_ratio(results, "topology", "fifo"),
        # Backfill alone explains part of the gap to FIFO; this isolates what placement adds.
        "jct_ratio_topology_vs_fifo_backfill": jct_ratio(results, "topology", "fifo-backfill"),
        "max_policy_wall_s": max(result.wall_s for result in results.values()),
    }


def _thin(values: list[Any], step: int) -> list[Any]:
    return values[::step] + values[-1:]


def write_plot(results: dict[str, PolicyResult], capacity: int, path: Path) -> None:
    """Accelerator utilization and queue length over time, one line per policy (PNG, Agg back end)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for name, result in results.items():
        timeline = result.timeline
        step = max(len(timeline.times_s) // PLOT_POINTS, 1)
        hours = [t / 3600 for t in _thin(timeline.times_s, step)]
        top.plot(hours, [b / capacity for b in _thin(timeline.busy_accelerators, step)], label=name, lw=0.8)
        bottom.plot(hours, _thin(timeline.queued_jobs, step), label=name, lw=0.8)
    top.set_ylabel("accelerator utilization")
    top.set_ylim(0, 1.02)
    bottom.set_ylabel("queued jobs")
    bottom.set_xlabel("simulated time (hours)")
    top.legend(loc="lower right", fontsize="small")
    top.set_title("utilization and queue length per policy")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
