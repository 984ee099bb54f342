"""`report.html` of a run: reward, response-length and reward-component curves per domain, and the step
time split, drawn from `metrics.jsonl`.

The plots are PNGs rendered with matplotlib's Agg backend and embedded as base64, so the page opens from
disk with no server and no network. The trainer rewrites it at every checkpoint and at the end of a run;
`write_report` replaces the file atomically. It reads metrics only: no model, no run state.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path

Row = dict[str, float]
Curves = dict[str, tuple[list[float], list[float]]]  # label -> (steps, values)
REPORT = "report.html"
TIMES = {"generate": "time/generate_s", "score": "time/score_s", "learn": "time/learn_s"}


def read_metrics(path: Path) -> list[Row]:
    """The rows of a `metrics.jsonl` (empty when the run has not finished a step yet)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def domains(rows: Sequence[Row]) -> list[str]:
    """Environment names (`family/name`) that have per-domain metrics."""
    found = {key.split("/")[1] + "/" + key.split("/")[2] for row in rows for key in row if _domain_key(key)}
    return sorted(found)


def _domain_key(key: str) -> bool:
    return key.startswith("domain/") and key.count("/") >= 3


def components(rows: Sequence[Row], domain: str) -> list[str]:
    """The reward components recorded for `domain` (`domain/<env>/reward/<component>`)."""
    prefix = f"domain/{domain}/reward/"
    return sorted({key.removeprefix(prefix) for row in rows for key in row if key.startswith(prefix)})


def curve(rows: Sequence[Row], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key` over the rows that have it."""
    picked = [(row["step"], row[key]) for row in rows if key in row]
    return [step for step, _ in picked], [value for _, value in picked]


def _png(title: str, ylabel: str, curves: Curves) -> str:
    """One line chart as a base64 PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to memory
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 3.2), dpi=100)
    try:
        for label, (steps, values) in curves.items():
            axes.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.set_ylabel(ylabel)
        axes.grid(alpha=0.3)
        if len(curves) > 1:
            axes.legend(fontsize=8)
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
    finally:
        plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def _summary(rows: Sequence[Row], names: Sequence[str]) -> str:
    """A table of each domain's first and latest reward and response length."""
    cells = []
    for name in names:
        steps, rewards = curve(rows, f"domain/{name}/reward")
        _, lengths = curve(rows, f"domain/{name}/response_tokens")
        if rewards:
            cells.append(
                f"<tr><td>{html.escape(name)}</td><td>{rewards[0]:.3f}</td><td>{rewards[-1]:.3f}</td>"
                f"<td>{lengths[-1]:.1f}</td><td>{int(steps[-1])}</td></tr>"
            )
    head = "<tr><th>domain</th><th>first reward</th><th>latest reward</th><th>tokens</th><th>step</th></tr>"
    return f"<table>{head}{''.join(cells)}</table>"


def render_report(rows: Sequence[Row], title: str) -> str:
    """The report page of `rows` (one per step) as self-contained HTML."""
    names = domains(rows)
    charts: list[tuple[str, str, Curves]] = [
        (
            "Reward per domain",
            "mean reward",
            {"all": curve(rows, "reward")} | {n: curve(rows, f"domain/{n}/reward") for n in names},
        ),
        (
            "Response length per domain",
            "tokens",
            {n: curve(rows, f"domain/{n}/response_tokens") for n in names},
        ),
    ]
    for name in names:
        parts = {c: curve(rows, f"domain/{name}/reward/{c}") for c in components(rows, name)}
        if parts:
            charts.append((f"Reward components: {name}", "mean component", parts))
    charts.append(("Seconds per step", "seconds", {label: curve(rows, key) for label, key in TIMES.items()}))
    body = [f"<h1>{html.escape(title)}</h1>", f"<p>Steps recorded: {len(rows)}.</p>", _summary(rows, names)]
    for chart_title, ylabel, curves in charts:
        drawn = {label: points for label, points in curves.items() if points[0]}
        if drawn:
            image = _png(chart_title, ylabel, drawn)
            body.append(
                f'<h2>{html.escape(chart_title)}</h2><img alt="{html.escape(chart_title)}" '
                f'src="data:image/png;base64,{image}">'
            )
    style = "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{padding:2px 10px}"
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n"
    )


def write_report(run_dir: Path) -> Path:
    """(Re)write `run_dir/report.html` from its `metrics.jsonl`, atomically."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    path = run_dir / REPORT
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_report(rows, f"tether run {run_dir.name}"))
    os.replace(tmp, path)
    return path
