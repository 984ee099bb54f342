"""The agents pages of the console: tasks with their state, budget use and cost (`/agents`), a task's step
timeline, live while it runs (`/agents/{task_id}`), and the actions of `tether agent`: submit, cancel and
resume, through the same `AgentStack`, `Journal` and `tether.agents.submission` functions as the CLI.

Pages and `/api/agents...` read through the same functions of `agent_reader`; the live timeline is an SSE
stream of HTML fragments (htmx's SSE extension appends them) that ends when the task does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from tether.agents.submission import resume_refusal
from tether.console.agent_reader import TaskSummary, Timeline, read_summaries, read_timeline
from tether.console.agent_request import TaskRequest
from tether.console.agent_stack import ConsoleAgents
from tether.console.errors import ConsoleError, bad_input, not_found
from tether.console.pages import render, root_of
from tether.console.state import Console
from tether.errors import describe_validation_error
from tether.store.journal import Journal, UnknownTask
from tether.store.records import TaskRecord, TaskStatus
from tether.web import AsciiJSONResponse

LIST_LIMIT = 100
STATES = tuple(status.value for status in TaskStatus)
HINT = "the tasks of this journal are listed at /agents (or `tether agent ls`)"
StateQuery = Annotated[str | None, Query(max_length=32)]
StepQuery = Annotated[int | None, Query(ge=0)]


def _state(given: str | None) -> TaskStatus | None:
    if not given:
        return None
    if given not in STATES:
        raise bad_input(f"state {given!r}: use one of {', '.join(STATES)}", "state")
    return TaskStatus(given)


def router(console: Console) -> APIRouter:
    routes = APIRouter()
    agents = ConsoleAgents(console.config.agents, console.config.poll_s)
    console.on_close(agents.close)
    jinja = console.jinja

    def summaries(state: TaskStatus | None) -> list[TaskSummary]:
        journal = agents.reading()
        return [] if journal is None else read_summaries(journal, LIST_LIMIT, state)

    def opened(task_id: str) -> tuple[Journal, TaskRecord]:
        journal = agents.reading()
        if journal is None:
            raise not_found("task", task_id, agents.missing() or HINT)
        try:
            return journal, journal.get_task(task_id)
        except UnknownTask:
            raise not_found("task", task_id, HINT) from None

    def timeline(task_id: str, before: int | None = None, after: int | None = None) -> Timeline:
        journal, task = opened(task_id)
        return read_timeline(journal, task, before, after)

    def fragment(request: Request, name: str, **context: Any) -> str:
        return jinja.get_template(name).render(root=root_of(request), **context)

    def body_context(task_id: str, before: int | None = None) -> dict[str, Any]:
        found = timeline(task_id, before)
        return {
            "s": found.summary,
            "steps": found.steps,
            "earlier": found.earlier,
            "pending": found.pending,
            "shown": found.shown,
            "task_id": task_id,
        }

    # ---- the list of tasks ----------------------------------------------------------------------------

    @routes.get("/agents", response_class=HTMLResponse)
    def agents_page(request: Request, state: StateQuery = None) -> HTMLResponse:
        wanted = _state(state)
        return render(
            jinja,
            request,
            "agents.html",
            active="agents",
            tasks=summaries(wanted),
            state=state or "",
            states=STATES,
            missing=agents.missing(),
            roles=agents.role_names,
            families=agents.family_names,
        )

    @routes.get("/agents/rows", response_class=HTMLResponse)
    def agents_rows(request: Request, state: StateQuery = None) -> HTMLResponse:
        return render(jinja, request, "agents_rows.html", tasks=summaries(_state(state)), state=state or "")

    @routes.get("/api/agents")
    def agents_json(state: StateQuery = None) -> AsciiJSONResponse:
        return AsciiJSONResponse([summary.as_json() for summary in summaries(_state(state))])

    # ---- a task and its timeline ----------------------------------------------------------------------

    @routes.get("/agents/{task_id}", response_class=HTMLResponse)
    def task_page(request: Request, task_id: str) -> HTMLResponse:
        return render(jinja, request, "agents_task.html", active="agents", **body_context(task_id))

    @routes.get("/agents/{task_id}/body", response_class=HTMLResponse)
    def task_body(request: Request, task_id: str) -> HTMLResponse:
        return render(jinja, request, "agents_body.html", **body_context(task_id))

    @routes.get("/agents/{task_id}/steps", response_class=HTMLResponse)
    def earlier_steps(request: Request, task_id: str, before: StepQuery = None) -> HTMLResponse:
        return render(jinja, request, "agents_steps.html", **body_context(task_id, before))

    @routes.get("/api/agents/{task_id}")
    def task_json(task_id: str, before: StepQuery = None) -> AsciiJSONResponse:
        found = timeline(task_id, before)
        return AsciiJSONResponse(
            {
                **found.summary.as_json(),
                "spec": found.summary.task.spec,
                "pending_step": None if found.pending is None else found.pending.step_no,
                "earlier_steps": found.earlier,
                "steps": [view.as_json() for view in found.steps],
            }
        )

    @routes.get("/api/agents/{task_id}/events")
    async def task_events(request: Request, task_id: str, after: StepQuery = 0) -> EventSourceResponse:
        """New steps as `step` events (HTML `<li>`s, id = step number), the task's summary as `summary`
        when it changes, and `end` once the task is finished. A reconnect resumes after Last-Event-ID."""
        await run_in_threadpool(opened, task_id)  # an unknown task is a 404, not an empty stream
        resumed_from = request.headers.get("last-event-id", "")
        sent = int(resumed_from) + 1 if resumed_from.isdigit() else (after or 0)
        return EventSourceResponse(_events(request, task_id, sent))

    async def _events(request: Request, task_id: str, sent: int) -> AsyncIterator[dict[str, str]]:
        last_summary = ""
        # The buttons are swapped only when what they offer changes, not with every summary: a button
        # swapped out while its request is in flight would lose the flash its answer goes to.
        last_actions: tuple[TaskStatus, bool] | None = None
        while not await request.is_disconnected():
            found = await run_in_threadpool(timeline, task_id, None, sent)
            task = found.summary.task
            if found.steps:
                html = fragment(request, "agents_steps.html", steps=found.steps, earlier=0, task_id=task_id)
                yield {"event": "step", "id": str(found.steps[-1].step_no), "data": html}
                sent = found.steps[-1].step_no + 1
            summary = fragment(request, "agents_summary.html", s=found.summary, pending=found.pending)
            if summary != last_summary:
                yield {"event": "summary", "data": summary}
                last_summary = summary
            actions = (task.status, task.cancel_requested)
            if last_actions is not None and actions != last_actions:
                yield {"event": "actions", "data": fragment(request, "agents_actions.html", task=task)}
            last_actions = actions
            if task.status.terminal:
                yield {"event": "end", "data": task.status.value}
                return
            await asyncio.sleep(agents.poll_s)

    # ---- actions --------------------------------------------------------------------------------------

    def flash(request: Request, message: str, task_id: str | None = None) -> Response:
        response = render(jinja, request, "agents_flash.html", message=message, task_id=task_id)
        response.headers["HX-Retarget"] = "#flash"
        response.headers["HX-Reswap"] = "innerHTML"
        response.headers["HX-Trigger"] = "task-changed"
        return response

    async def submit(given: dict[str, Any]) -> str:
        try:
            wanted = TaskRequest.model_validate(given)
        except ValidationError as error:
            raise bad_input(describe_validation_error(error, "task", TaskRequest)) from None
        spec = wanted.spec()
        stack = await run_in_threadpool(agents.writing)
        return await stack.submit(spec)

    async def cancel(task_id: str) -> TaskRecord:
        _, task = await run_in_threadpool(opened, task_id)
        if task.status.terminal:
            raise ConsoleError(
                409,
                f"task {task_id} is already {task.status.value}; there is nothing to cancel",
                "task_finished",
            )
        stack = await run_in_threadpool(agents.writing)
        return await run_in_threadpool(stack.journal.request_cancel, task_id)

    async def resume(task_id: str) -> int:
        journal, task = await run_in_threadpool(opened, task_id)
        steps = await run_in_threadpool(journal.steps, task_id)
        refusal = resume_refusal(task, steps)
        if refusal is not None:
            raise ConsoleError(409, refusal, "cannot_resume")
        stack = await run_in_threadpool(agents.writing)
        await stack.resume(task_id)
        return len(steps)

    @routes.post("/agents", response_class=HTMLResponse)
    async def submit_form(request: Request) -> Response:
        form = await request.form()
        task_id = await submit({key: value for key, value in form.items() if isinstance(value, str)})
        return flash(request, f"submitted task {task_id}; a `tether worker` on this journal runs it", task_id)

    @routes.post("/api/agents")
    async def submit_json(request: Request) -> AsciiJSONResponse:
        try:
            given = await request.json()
        except ValueError:
            raise bad_input("the body must be a JSON object of task fields") from None
        if not isinstance(given, dict):
            raise bad_input("the body must be a JSON object of task fields")
        return AsciiJSONResponse({"task_id": await submit(given), "status": "queued"}, status_code=201)

    @routes.post("/agents/{task_id}/cancel", response_class=HTMLResponse)
    async def cancel_form(request: Request, task_id: str) -> Response:
        task = await cancel(task_id)
        said = (
            "cancelled" if task.status.terminal else "cancel requested: its worker stops before the next step"
        )
        return flash(request, f"task {task_id} {said}", task_id)

    @routes.post("/api/agents/{task_id}/cancel")
    async def cancel_json(task_id: str) -> AsciiJSONResponse:
        task = await cancel(task_id)
        return AsciiJSONResponse({"task_id": task_id, "status": task.status.value, "cancel_requested": True})

    @routes.post("/agents/{task_id}/resume", response_class=HTMLResponse)
    async def resume_form(request: Request, task_id: str) -> Response:
        at = await resume(task_id)
        return flash(
            request, f"task {task_id} queued to continue from step {at}; a worker takes it next", task_id
        )

    @routes.post("/api/agents/{task_id}/resume")
    async def resume_json(task_id: str) -> AsciiJSONResponse:
        at = await resume(task_id)
        return AsciiJSONResponse({"task_id": task_id, "status": "queued", "next_step": at})

    return routes
