"""The runs pages of the console: the list of runs (`/runs`, `/api/runs`) and a run's page (`/runs/{name}`:
curves, held-out evaluation, monitor warnings, sample transcripts, configuration), with its JSON
(`/api/runs/{name}`, `.../series`, `.../transcripts`) and its live stream (`.../events`: the new metrics
rows as `points` while the run trains, then `end`). HTML and JSON come from the same readers
(`run_reader`, `run_charts`, `run_transcripts`); nothing here writes to a run.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse
from sse_starlette.sse import EventSourceResponse

from tether.console.errors import ConsoleError, bad_input
from tether.console.pages import render
from tether.console.run_charts import STEP, chart_plans, points, run_domains, thin
from tether.console.run_evals import episode_row, find_eval, list_evals, read_summary, summarize_eval
from tether.console.run_reader import (
    METRICS,
    TRANSCRIPTS,
    MetricsCache,
    RunFiles,
    RunStatus,
    RunSummary,
    check_name,
    find_run,
    list_runs,
    read_rows,
    read_run,
    summarize_run,
)
from tether.console.run_transcripts import TranscriptFilter, TranscriptPage, transcript_page
from tether.console.state import Console


def _filter(request: Request, known: list[str]) -> TranscriptFilter:
    """The transcript filter of the request's query, checked against the run's `known` domains."""
    given = request.query_params
    return TranscriptFilter.parse(
        given.get("domain"),
        given.get("min_reward"),
        given.get("max_reward"),
        given.get("qc"),
        given.get("page"),
    ).check(known)


def _eval_domains(episodes: Path) -> list[str]:
    summary = read_summary(episodes) or {}
    named = [str(row.get("env")) for row in summary.get("domains", []) if isinstance(row, dict)]
    return named or sorted({str(row.get("env")) for row in read_rows(episodes)[0]})


def _no_curves(name: str) -> ConsoleError:
    return bad_input(f"run {name!r} is a `tether eval` output: it has no training curves", "name")


def _sections(files: RunFiles) -> list[tuple[str, list[dict[str, Any]]]]:
    """The charts grouped by section, in order, each as console.js's spec."""
    shown = thin(files.rows)
    grouped: dict[str, list[dict[str, Any]]] = {}
    for plan in chart_plans(files.rows):
        grouped.setdefault(plan.section, []).append(plan.spec(shown))
    return list(grouped.items())


def router(console: Console) -> APIRouter:
    routes = APIRouter()
    roots = console.config.runs
    metrics = MetricsCache()

    def every_run() -> list[RunSummary]:
        """Training runs and evals, the most recently written first."""
        now = time.time()
        found = list_runs(roots, now) + list_evals(roots, now)
        return sorted(found, key=lambda run: run.updated_at or 0.0, reverse=True)

    def transcripts(request: Request, name: str) -> tuple[TranscriptFilter, TranscriptPage]:
        episodes = find_eval(roots, check_name(name))
        if episodes is not None:
            chosen = _filter(request, _eval_domains(episodes))
            return chosen, transcript_page(episodes, chosen, shape=episode_row)
        run_dir = find_run(roots, name)
        chosen = _filter(request, run_domains(metrics.rows(run_dir)))
        return chosen, transcript_page(run_dir / TRANSCRIPTS, chosen)

    def eval_page(request: Request, episodes: Path) -> HTMLResponse:
        chosen, page = transcripts(request, episodes.stem)
        return render(
            console.jinja,
            request,
            "runs_eval.html",
            active="runs",
            run=summarize_eval(episodes, time.time()),
            summary=read_summary(episodes),
            domains=_eval_domains(episodes),
            chosen=chosen,
            transcripts=page,
        )

    @routes.get("/runs", response_class=HTMLResponse)
    async def runs_page(request: Request) -> HTMLResponse:
        runs = every_run()
        return render(console.jinja, request, "runs.html", active="runs", runs=runs, roots=roots)

    @routes.get("/api/runs")
    async def runs_json() -> dict[str, Any]:
        return {"runs": [run.to_dict() for run in every_run()]}

    @routes.get("/runs/{name}", response_class=HTMLResponse)
    async def run_page(request: Request, name: str) -> HTMLResponse:
        episodes = find_eval(roots, check_name(name))
        if episodes is not None:
            return eval_page(request, episodes)
        run_dir = find_run(roots, name)
        files = read_run(run_dir, time.time(), metrics.rows(run_dir))
        names = run_domains(files.rows)
        chosen, page = transcripts(request, name)
        return render(
            console.jinja,
            request,
            "runs_run.html",
            active="runs",
            run=files.summary,
            files=files,
            sections=_sections(files),
            live=files.summary.status is RunStatus.RUNNING,
            domains=names,
            chosen=chosen,
            transcripts=page,
        )

    @routes.get("/runs/{name}/transcripts", response_class=HTMLResponse)
    async def transcripts_fragment(request: Request, name: str) -> HTMLResponse:
        chosen, page = transcripts(request, name)
        return render(
            console.jinja, request, "runs_transcripts.html", run_name=name, chosen=chosen, transcripts=page
        )

    @routes.get("/api/runs/{name}")
    async def run_json(name: str) -> dict[str, Any]:
        episodes = find_eval(roots, check_name(name))
        if episodes is not None:
            return {**summarize_eval(episodes, time.time()).to_dict(), "summary": read_summary(episodes)}
        run_dir = find_run(roots, name)
        files = read_run(run_dir, time.time(), metrics.rows(run_dir))
        return {
            **files.summary.to_dict(),
            "domains": run_domains(files.rows),
            "charts": [{"title": p.title, "metrics": p.keys} for p in chart_plans(files.rows)],
            "evaluation": files.evaluation,
            "cost": files.cost,
            "warnings": files.warnings,
            "config": files.config_text,
        }

    @routes.get("/api/runs/{name}/series")
    async def series_json(
        name: str,
        since: int = Query(0, ge=0, description="only steps after this one"),
        max_points: int = Query(0, ge=0, le=100_000, description="thin to this many points (0: all)"),
    ) -> dict[str, Any]:
        if find_eval(roots, check_name(name)) is not None:
            raise _no_curves(name)
        rows = [row for row in metrics.rows(find_run(roots, name)) if row.get(STEP, 0) > since]
        return {"points": points(thin(rows, max_points) if max_points else rows)}

    @routes.get("/api/runs/{name}/transcripts")
    async def transcripts_json(request: Request, name: str) -> dict[str, Any]:
        return transcripts(request, name)[1].to_dict()

    @routes.get("/api/runs/{name}/events")
    async def run_events(
        request: Request, name: str, since: int = Query(0, ge=0, description="send steps after this one")
    ) -> EventSourceResponse:
        if find_eval(roots, check_name(name)) is not None:
            raise _no_curves(name)
        run_dir = find_run(roots, name)
        return EventSourceResponse(_stream(request, run_dir, since, console.config.poll_s))

    return routes


async def _stream(
    request: Request, run_dir: Path, since: int, poll_s: float
) -> AsyncIterator[dict[str, str]]:
    """New metrics rows as `points` every `poll_s`, then `end` once the run no longer runs (or the client
    has gone)."""
    offset, last = 0, float(since)
    while True:
        # The status first: a run that finished after this look still has its last rows read below.
        status = summarize_run(run_dir, time.time()).status
        rows, offset = read_rows(run_dir / METRICS, offset)
        fresh = [row for row in rows if row.get(STEP, 0) > last]
        if fresh:
            last = fresh[-1].get(STEP, last)
            yield {"event": "points", "data": json.dumps(points(fresh))}
        if status is not RunStatus.RUNNING:
            yield {"event": "end", "data": json.dumps({"status": status.value})}
            return
        if await request.is_disconnected():
            return
        await asyncio.sleep(poll_s)
