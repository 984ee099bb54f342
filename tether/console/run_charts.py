"""The run page's charts, planned from `metrics.jsonl` rows with the metric names the trainer writes:
over all domains (reward per domain, seconds per step split into generate/score/learn/push, staleness,
`learner/max_logprob_diff` and the loss), then per domain (reward and each component, response length,
truncation). Pure: rows in, chart specs (console.js's `data-chart` JSON) and live points out.

A long run's curves are thinned to every k-th step (and always its last), so a page of a 10,000-step run
carries at most `MAX_POINTS` points per curve; the live stream sends every new step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tether.rl.report import ALL, TIMES, Row, components, domains

MAX_POINTS = 250
STEP = "step"
# Beyond the report's split: the push of new weights, and (async runs) the wait for a generated batch.
EXTRA_TIMES = {"push": "time/push_s", "wait": "time/wait_s"}


@dataclass(frozen=True, slots=True)
class ChartPlan:
    section: str  # "Training" or the domain's name
    title: str
    keys: list[str]  # metric names, one line each
    labels: list[str]  # what the legend calls them

    def spec(self, rows: Sequence[Row]) -> dict[str, Any]:
        """console.js's chart: x = step, one list of values per key (None where a row lacks it)."""
        return {
            "title": self.title,
            "series": self.keys,
            "labels": self.labels,
            "data": [
                [row.get(STEP) for row in rows],
                *[[_finite(row.get(key)) for row in rows] for key in self.keys],
            ],
        }


def _finite(value: object) -> float | None:
    # JSON has no NaN or infinity: a diverged loss is drawn as a gap.
    # Four significant digits are more than a chart can show, and keep a long run's page small.
    if isinstance(value, int | float) and math.isfinite(value):
        return float(f"{value:.4g}")
    return None


def metric_names(rows: Sequence[Row]) -> Row:
    """Every metric name of `rows` once, as a row (for `tether.rl.report`'s readers of names): a run's
    rows share their keys, and 1,000 rows hold 100,000 of them."""
    return dict.fromkeys({key for row in rows for key in row}, 0.0)


def run_domains(rows: Sequence[Row]) -> list[str]:
    return domains([metric_names(rows)])


def chart_plans(rows: Sequence[Row]) -> list[ChartPlan]:
    """Every chart that has at least one of its metrics in `rows`, with those of its lines."""
    every = [metric_names(rows)]
    present = every[0]
    names = domains(every)
    times = {**TIMES, **EXTRA_TIMES}
    plans = [
        ChartPlan(
            "Training", "Reward per domain", ["reward", *(f"domain/{n}/reward" for n in names)], [ALL, *names]
        ),
        ChartPlan("Training", "Seconds per step", list(times.values()), list(times)),
        ChartPlan(
            "Training", "Staleness (policy versions)", ["staleness_mean", "staleness_max"], ["mean", "max"]
        ),
        ChartPlan("Training", "learner/max_logprob_diff", ["learner/max_logprob_diff"], ["max logprob diff"]),
        ChartPlan("Training", "Learner loss and KL", ["learner/loss", "learner/kl"], ["loss", "kl"]),
    ]
    for name in names:
        parts = components(every, name)
        prefix = f"domain/{name}/"
        plans += [
            ChartPlan(
                name,
                f"{name}: reward and components",
                [f"{prefix}reward", *(f"{prefix}reward/{part}" for part in parts)],
                ["reward", *parts],
            ),
            ChartPlan(name, f"{name}: response length (tokens)", [f"{prefix}response_tokens"], ["tokens"]),
            ChartPlan(name, f"{name}: truncation rate", [f"{prefix}truncation_rate"], ["truncated"]),
        ]
    shown = []
    for plan in plans:  # each chart with the lines the run has (a metric that comes later: on reload)
        kept = [(key, label) for key, label in zip(plan.keys, plan.labels, strict=True) if key in present]
        if kept:
            keys, labels = zip(*kept, strict=True)
            shown.append(ChartPlan(plan.section, plan.title, list(keys), list(labels)))
    return shown


def thin(rows: Sequence[Row], max_points: int = MAX_POINTS) -> list[Row]:
    """Every k-th row (k chosen so at most `max_points` remain), always with the last one."""
    if len(rows) <= max_points:
        return list(rows)
    stride = math.ceil(len(rows) / (max_points - 1))
    kept = list(rows[::stride])
    if kept[-1] is not rows[-1]:
        kept.append(rows[-1])
    return kept


def points(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Live points for console.js: {"x": step, "values": {metric: value}}, every metric of each row (a
    chart takes the ones it draws)."""
    return [
        {"x": row.get(STEP), "values": {key: _finite(value) for key, value in row.items() if key != STEP}}
        for row in rows
    ]
