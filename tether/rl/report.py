"""`report.html` of a run: the held-out evaluation (when the run had one) at the top, then reward,
response-length and reward-component curves per domain, the reward-hacking monitors and their
warnings, what the rollouts would cost at the gateway's prices, every logged learner metric and the step
time split, drawn from `metrics.jsonl` (with `warnings.jsonl` and the exact totals of `cost.json`).

Each domain keeps one colour, marker and dash pattern in every chart and in the tables (`domain_styles`),
and later lines are drawn thinner, so a line that lies on another still shows. The charts are planned as
plain data (`charts`), then rendered as PNGs with matplotlib's Agg backend and embedded as base64, so the
page opens from disk with no server and no network. The trainer rewrites it at every checkpoint and at
the end of a run; `write_report` replaces the file atomically and keeps the evaluation it was once given
(`evaluation.json`). It reads those files only: no model, no run state.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.chat.pricing import DEFAULT_PRICES, Tier
from tether.rl.cost import COST_FILE, OUTPUT, PROMPT_CACHED, PROMPT_UNCACHED, cost_key, summarize
from tether.rl.monitors import PREFIX as MONITOR
from tether.rl.monitors import WARNINGS_FILE
from tether.rl.report_sections import Monitor

Row = dict[str, float]
Curves = dict[str, tuple[list[float], list[float]]]  # label -> (steps, values)
Evaluation = Sequence[Mapping[str, Any]]  # rows of `Comparison.to_dict()` (tether/rl/demo.py), `all` last
REPORT = "report.html"
EVALUATION = "evaluation.json"
ALL = "all"  # the line (and evaluation row) over every domain
TIMES = {"generate": "time/generate_s", "score": "time/score_s", "learn": "time/learn_s"}
LEARNER = "learner/"
# matplotlib's tab10, by hand: the plan needs the colours without importing matplotlib.
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
    "#7f7f7f",
)
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
DASHES = ("-", "--", "-.", ":")
NEUTRAL = ("#333333", "#888888", "#bbbbbb")  # lines that are not domains: time split, one learner metric


@dataclass(frozen=True, slots=True)
class Style:
    color: str
    marker: str
    linestyle: str
    linewidth: float


@dataclass(frozen=True, slots=True)
class Line:
    label: str
    steps: list[float]
    values: list[float]
    style: Style


@dataclass(frozen=True, slots=True)
class Chart:
    section: str
    title: str
    ylabel: str
    lines: list[Line]


def read_metrics(path: Path) -> list[Row]:
    """The rows of a `metrics.jsonl` (empty when the run has not finished a step yet)."""
    return read_jsonl(path)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file of the run (empty when there is none yet)."""
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


def learner_metrics(rows: Sequence[Row]) -> list[str]:
    """Every `learner/...` key logged in any row (loss, KL, grad norm, logprob gap, ratios, ...)."""
    return sorted({key for row in rows for key in row if key.startswith(LEARNER)})


def curve(rows: Sequence[Row], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key` over the rows that have it."""
    picked = [(row["step"], row[key]) for row in rows if key in row]
    return [step for step, _ in picked], [value for _, value in picked]


def _style(index: int, color: str) -> Style:
    # Thinner with each line: one drawn over an earlier one leaves the earlier one's edges visible.
    return Style(
        color, MARKERS[index % len(MARKERS)], DASHES[index % len(DASHES)], max(1.0, 3.2 - 0.5 * index)
    )


def domain_styles(names: Sequence[str]) -> dict[str, Style]:
    """One style per domain for the whole report (`all` in black, drawn first and widest)."""
    styles = {ALL: Style("#000000", "", "-", 3.6)}
    for index, name in enumerate(names):
        styles[name] = _style(index, PALETTE[index % len(PALETTE)])
    return styles


def charts(rows: Sequence[Row], names: Sequence[str] | None = None) -> list[Chart]:
    """What the report draws, as data: every chart's lines with their styles (empty curves left out)."""
    names = domains(rows) if names is None else names
    styles = domain_styles(names)

    def lines(curves: Curves, style: Mapping[str, Style]) -> list[Line]:
        return [Line(label, *points, style[label]) for label, points in curves.items() if points[0]]

    planned = [
        Chart(
            "Reward",
            "Reward per domain",
            "mean reward",
            lines(
                {ALL: curve(rows, "reward")} | {n: curve(rows, f"domain/{n}/reward") for n in names}, styles
            ),
        ),
        Chart(
            "Reward",
            "Response length per domain",
            "tokens",
            lines({n: curve(rows, f"domain/{n}/response_tokens") for n in names}, styles),
        ),
    ]
    for name in names:  # the domain's own colour, one dash pattern and marker per component
        parts = {c: curve(rows, f"domain/{name}/reward/{c}") for c in components(rows, name)}
        part_styles = {c: _style(i, styles[name].color) for i, c in enumerate(parts)}
        planned.append(
            Chart("Reward", f"Reward components: {name}", "mean component", lines(parts, part_styles))
        )
    for key in learner_metrics(rows):
        planned.append(
            Chart("Learner", key, "value", lines({key: curve(rows, key)}, {key: _style(0, NEUTRAL[0])}))
        )
    for monitor in Monitor:  # one chart per monitor, a line per domain that has it
        found = {n: curve(rows, f"{MONITOR}{n}/{monitor.value}") for n in names}
        planned.append(Chart("Reward hacking monitors", monitor.value, "value", lines(found, styles)))
    cost = {tier.value: curve(rows, cost_key(tier)) for tier in Tier}
    planned.append(Chart("Cost", "Rollout cost per step", "USD", lines(cost, _neutral(cost))))
    tokens = {"prompt cached": PROMPT_CACHED, "prompt uncached": PROMPT_UNCACHED, "output": OUTPUT}
    token_curves = {label: curve(rows, key) for label, key in tokens.items()}
    planned.append(Chart("Cost", "Rollout tokens per step", "tokens", lines(token_curves, _neutral(tokens))))
    time_styles = {label: _style(i, NEUTRAL[i % len(NEUTRAL)]) for i, label in enumerate(TIMES)}
    planned.append(
        Chart(
            "Time",
            "Seconds per step",
            "seconds",
            lines({label: curve(rows, key) for label, key in TIMES.items()}, time_styles),
        )
    )
    return [chart for chart in planned if chart.lines]


def _neutral(labels: Mapping[str, object]) -> dict[str, Style]:
    return {label: _style(i, NEUTRAL[i % len(NEUTRAL)]) for i, label in enumerate(labels)}


def _png(chart: Chart, small: bool) -> str:
    """One line chart as a base64 PNG.

    Drawn on a bare Agg figure with fixed margins: `tight_layout` would draw every chart twice to measure
    it, and a report is redrawn at every checkpoint."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    width, height = (4.6, 2.6) if small else (7, 3.2)
    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    # Margins in inches (room for the title, tick labels and axis labels), as fractions of the figure.
    figure.subplots_adjust(
        left=0.8 / width, right=1 - 0.15 / width, bottom=0.5 / height, top=1 - 0.35 / height
    )
    axes = figure.add_subplot()
    for line in chart.lines:
        style = line.style
        axes.plot(
            line.steps,
            line.values,
            color=style.color,
            linestyle=style.linestyle,
            linewidth=style.linewidth,
            marker=(style.marker or None) if len(line.steps) < 30 else None,
            markersize=4,
            markerfacecolor="none",
            alpha=0.9,
            label=line.label,
        )
    axes.set_title(chart.title)
    axes.set_xlabel("step")
    axes.set_ylabel(chart.ylabel)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    axes.grid(alpha=0.3)
    if len(chart.lines) > 1 or chart.lines[0].label != chart.title:  # a lone component is named too
        axes.legend(fontsize=8)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return base64.b64encode(buffer.getvalue()).decode()


def _swatch(style: Style | None) -> str:
    color = style.color if style is not None else "transparent"
    return f'<span class="swatch" style="background:{color}"></span>'


def _evaluation_table(evaluation: Evaluation, steps: int, styles: Mapping[str, Style]) -> str:
    """The run's headline: held-out reward and pass rate per domain before and after training."""
    head = "".join(
        f"<th>{column}</th>"
        for column in ("domain", "prompts x n", "before", "after", "gain", "noise (2 se)", "pass", "verdict")
    )
    cells = []
    for row in evaluation:
        env = str(row["env"])
        total = ' class="total"' if env == ALL else ""
        cells.append(
            f"<tr{total}><td>{_swatch(styles.get(env))}{html.escape(env)}</td>"
            f"<td>{row['prompts']} x {row['samples_per_prompt']}</td><td>{row['reward_before']:.3f}</td>"
            f"<td>{row['reward_after']:.3f}</td><td>{row['delta']:+.3f}</td><td>{row['noise']:.3f}</td>"
            f"<td>{row['pass_before']:.0%} &rarr; {row['pass_after']:.0%}</td>"
            f"<td>{'clear gain' if row['clear'] else 'within noise'}</td></tr>"
        )
    title = f"Held-out evaluation before and after {steps} RL steps"
    return f'<h2>{title}</h2><table id="evaluation"><tr>{head}</tr>{"".join(cells)}</table>'


def _summary(rows: Sequence[Row], names: Sequence[str], styles: Mapping[str, Style]) -> str:
    """A table of each domain's first and latest training reward and response length."""
    cells = []
    for name in names:
        steps, rewards = curve(rows, f"domain/{name}/reward")
        _, lengths = curve(rows, f"domain/{name}/response_tokens")
        if rewards:
            cells.append(
                f"<tr><td>{_swatch(styles[name])}{html.escape(name)}</td><td>{rewards[0]:.3f}</td>"
                f"<td>{rewards[-1]:.3f}</td><td>{lengths[-1]:.1f}</td><td>{int(steps[-1])}</td></tr>"
            )
    head = "<tr><th>domain</th><th>first reward</th><th>latest reward</th><th>tokens</th><th>step</th></tr>"
    return f"<h2>Training</h2><table>{head}{''.join(cells)}</table>"


def _failover(rows: Sequence[Row]) -> str:
    """A line saying how often the run resumed after losing its learner and replaced rollout workers
    (Ray backend: `run/resumptions`, `rollout/workers_replaced`); empty when it never had to."""
    resumed = int(max((row.get("run/resumptions", 0.0) for row in rows), default=0.0))
    replaced = int(sum(row.get("rollout/workers_replaced", 0.0) for row in rows))
    if not resumed and not replaced:
        return ""
    return (
        f'<p class="failover">Resumed from its last checkpoint {resumed} time(s) after losing the learner; '
        f"{replaced} rollout worker(s) replaced.</p>"
    )


def _cost_table(rows: Sequence[Row], cost: Mapping[str, Any] | None) -> str:
    """The run's tokens and their exact cost per tier (`cost.json`; without one, at default prices)."""
    if cost is None:
        cost = summarize(rows, DEFAULT_PRICES).to_dict()
        note = "at the gateway's default prices"
    else:
        note = "at the run's [cost] prices"
    tokens = cost["tokens"]
    head = "".join(f"<th>{c}</th>" for c in ("tier", "total USD", "prompt cached", "uncached", "output"))
    cells = "".join(
        f"<tr><td>{tier.value}</td><td>${html.escape(str(cost[cost_key(tier) + '_total']))}</td>"
        f"<td>{tokens['prompt_cached']}</td><td>{tokens['prompt_uncached']}</td><td>{tokens['output']}</td></tr>"
        for tier in Tier
    )
    return (
        f"<h2>Cost</h2><p>What the rollouts of {cost['steps']} steps would cost at the gateway, {note}; "
        f"sandbox CPU {float(cost['sandbox_cpu_s']):.2f} s.</p>"
        f'<table id="cost"><tr>{head}</tr>{cells}</table>'
    )


def _warnings(warnings: Sequence[Mapping[str, Any]]) -> str:
    """Each (domain, monitor) that went over its threshold: in how many steps, first and last, worst."""
    seen: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for warning in warnings:
        seen.setdefault((str(warning["domain"]), str(warning["monitor"])), []).append(warning)
    if not seen:
        return '<h2>Warnings</h2><p id="warnings">No monitor went over its threshold.</p>'
    head = "".join(f"<th>{c}</th>" for c in ("domain", "monitor", "steps", "first", "last", "worst", "limit"))
    cells = "".join(
        f"<tr><td>{html.escape(domain)}</td><td>{html.escape(monitor)}</td><td>{len(found)}</td>"
        f"<td>{found[0]['step']}</td><td>{found[-1]['step']}</td>"
        f"<td>{max(float(w['value']) for w in found):.3f}</td><td>{found[0]['threshold']}</td></tr>"
        for (domain, monitor), found in seen.items()
    )
    return f'<h2>Warnings</h2><table id="warnings"><tr>{head}</tr>{cells}</table>'


def render_report(
    rows: Sequence[Row],
    title: str,
    evaluation: Evaluation | None = None,
    warnings: Sequence[Mapping[str, Any]] = (),
    cost: Mapping[str, Any] | None = None,
) -> str:
    """The report page of `rows` (one per step) as self-contained HTML, `evaluation` at the top, then
    the monitors' `warnings` (rows of `warnings.jsonl`) and the run's `cost` (`cost.json`)."""
    names = domains(rows)
    names += [str(row["env"]) for row in evaluation or () if row["env"] != ALL and row["env"] not in names]
    styles = domain_styles(names)
    body = [f"<h1>{html.escape(title)}</h1>"]
    if evaluation:
        body.append(_evaluation_table(evaluation, len(rows), styles))
    body += [
        f"<p>Steps recorded: {len(rows)}.</p>",
        _failover(rows),
        _summary(rows, names, styles),
        _warnings(warnings),
        _cost_table(rows, cost),
    ]
    section = ""
    for chart in charts(rows, names):
        if chart.section != section:
            body.append(f'{"</div>" if section else ""}<h2>{chart.section}</h2><div class="charts">')
            section = chart.section
        image = _png(chart, small=chart.section == "Learner")
        body.append(f'<img alt="{html.escape(chart.title)}" src="data:image/png;base64,{image}">')
    if section:
        body.append("</div>")
    style = (
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{padding:2px 10px}"
        "td{text-align:right}td:first-child{text-align:left}tr.total{font-weight:bold}"
        ".swatch{display:inline-block;width:.8em;height:.8em;margin-right:.4em}"
        ".charts{display:flex;flex-wrap:wrap;gap:8px}"
    )
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n"
    )


def write_report(run_dir: Path, evaluation: Evaluation | None = None) -> Path:
    """(Re)write `run_dir/report.html` from its `metrics.jsonl`, atomically. An `evaluation` is kept in
    `evaluation.json`, so that later rewrites (a resumed run's checkpoints) still show it."""
    stored = run_dir / EVALUATION
    if evaluation is not None:
        stored.write_text(json.dumps(list(evaluation), indent=2) + "\n")
    elif stored.is_file():
        evaluation = json.loads(stored.read_text())
    rows = read_metrics(run_dir / "metrics.jsonl")
    warnings = read_jsonl(run_dir / WARNINGS_FILE)
    cost = json.loads((run_dir / COST_FILE).read_text()) if (run_dir / COST_FILE).is_file() else None
    path = run_dir / REPORT
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_report(rows, f"tether run {run_dir.name}", evaluation, warnings, cost))
    os.replace(tmp, path)
    return path
