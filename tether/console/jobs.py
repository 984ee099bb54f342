"""The jobs pages: the local scheduler's queue, its running jobs with their placements (devices, ports,
process), and the latest finished ones, from the job store `tether jobs` uses. Read-only: unlike
`tether jobs list`, opening the page never schedules (starts) a job.

`/jobs`, its live fragment and `/api/jobs` read `JobBoard.read`; `/jobs/{id}` and `/api/jobs/{id}` one
record, with the tail of its log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse

from tether.console.errors import not_configured, not_found
from tether.console.pages import render
from tether.console.state import Console
from tether.scheduler.job import JobState
from tether.scheduler.store import JobRecord, JobStore

FINISHED_SHOWN = 50
LOG_TAIL_BYTES = 8192
StateFilter = Annotated[JobState | None, Query(description="Only jobs in this state.")]
# SQLite's integers end at 2**63 - 1: a larger id is refused as input, not failed on
JobId = Annotated[int, PathParam(ge=1, le=2**63 - 1, description="A job id from `tether jobs list`.")]
RUNNING = (JobState.RUNNING, JobState.PREEMPTING)
FINISHED = (JobState.DONE, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True, slots=True)
class JobBoard:
    """The store's jobs by where they stand; `policy` and `accelerators` as the scheduler remembered them."""

    store: str
    policy: str | None
    accelerators: int | None
    queued: list[JobRecord]
    running: list[JobRecord]
    finished: list[JobRecord]
    finished_total: int

    @classmethod
    def read(cls, store: JobStore, state: JobState | None) -> JobBoard:
        records = store.all((state,) if state else ())
        capacity = json.loads(store.meta("capacity") or "{}")
        # the queue in the order the scheduler considers it: priority first, then first come
        queued = sorted(
            (r for r in records if r.state is JobState.QUEUED), key=lambda r: (-r.request.priority, r.id)
        )
        finished = [r for r in reversed(records) if r.state in FINISHED]
        return cls(
            store=str(store.path),
            policy=store.meta("policy"),
            accelerators=capacity.get("accelerators"),
            queued=queued,
            running=[r for r in records if r.state in RUNNING],
            finished=finished[:FINISHED_SHOWN],
            finished_total=len(finished),
        )

    def summary(self) -> dict[str, object]:
        return {
            "store": self.store,
            "policy": self.policy,
            "machine": {"accelerators": self.accelerators},
            "queued": [r.summary() for r in self.queued],
            "running": [r.summary() for r in self.running],
            "finished": [r.summary() for r in self.finished],
            "finished_total": self.finished_total,
        }


def placement(record: JobRecord) -> str:
    """Where a running job is: its accelerators, ports and supervisor process; '-' for one not placed."""
    parts = []
    if record.devices:
        parts.append(f"devices {','.join(map(str, record.devices))}")
    if record.ports:
        parts.append(f"ports {','.join(map(str, record.ports))}")
    if record.pid is not None and record.state in RUNNING:
        parts.append(f"pid {record.pid}")
    return " · ".join(parts) or "-"


def log_tail(record: JobRecord) -> str | None:
    """The end of the job's log file, or None if it has none (yet)."""
    path = Path(record.log_path)
    try:
        with path.open("rb") as log:
            size = log.seek(0, 2)
            log.seek(max(size - LOG_TAIL_BYTES, 0))
            return log.read().decode("utf-8", errors="replace")
    except (OSError, ValueError):
        return None


def router(console: Console) -> APIRouter:
    routes = APIRouter()

    @contextmanager
    def opened() -> Iterator[JobStore]:
        if console.config.jobs_db is None:
            raise not_configured("the job store", "--jobs-db PATH")
        store = JobStore(console.config.jobs_db)
        try:
            yield store
        finally:
            store.close()

    def record(job_id: JobId) -> JobRecord:
        with opened() as store:
            found = store.get(job_id)
            if found is None:
                raise not_found("job", str(job_id), f"`tether jobs list --db {store.path}` lists the jobs")
        return found

    def board(state: JobState | None) -> JobBoard:
        with opened() as store:
            return JobBoard.read(store, state)

    def page(request: Request, name: str, state: JobState | None) -> HTMLResponse:
        poll_s = max(console.config.poll_s, 1.0)
        chosen = board(state)
        return render(
            console.jinja,
            request,
            name,
            active="jobs",
            board=chosen,
            state=state,
            states=JobState,
            placement=placement,
            poll_s=poll_s,
        )

    @routes.get("/jobs", response_class=HTMLResponse)
    async def jobs_page(request: Request, state: StateFilter = None) -> HTMLResponse:
        return page(request, "jobs.html", state)

    @routes.get("/jobs/panel", response_class=HTMLResponse)
    async def jobs_panel(request: Request, state: StateFilter = None) -> HTMLResponse:
        return page(request, "jobs_panel.html", state)

    @routes.get("/api/jobs")
    async def jobs_api(state: StateFilter = None) -> dict[str, object]:
        return board(state).summary()

    @routes.get("/jobs/{job_id}", response_class=HTMLResponse)
    async def job_page(request: Request, job_id: JobId) -> HTMLResponse:
        found = record(job_id)
        return render(console.jinja, request, "jobs_job.html", active="jobs", job=found, log=log_tail(found))

    @routes.get("/api/jobs/{job_id}")
    async def job_api(job_id: JobId) -> dict[str, object]:
        found = record(job_id)
        return {**found.summary(), "log_tail": log_tail(found)}

    return routes
