"""HTTP front of one `SandboxPool`: tether's native API, SandboxFusion's `/run_code`, health and metrics.

    POST /run_code                       SandboxFusion's request and response, field for field
    POST /v1/run                         native: RunBody -> RunResult
    POST /v1/sessions                    {"spec"?: {...}} -> 201 {"id": ...}; 503 + Retry-After when full
    POST /v1/sessions/{id}/run           SessionRunBody -> RunResult
    PUT  /v1/sessions/{id}/files         {"files": {path: base64}} -> 204
    GET  /v1/sessions/{id}/files?path=a&path=b   -> {"files": {path: base64}}; any missing path -> 404
    DELETE /v1/sessions/{id}             -> 204
    GET  /v1/load                        {instance, slots, busy, queue_depth, max_queued, open_sessions,
                                         warm}: cheap (no run), what a fleet client dispatches by
    GET  /healthz                        one trivial run through the pool: 200 or 503, with slot usage
                                         (503 "full" at once when open sessions hold every slot)
    GET  /metrics                        Prometheus text, from a registry owned by this app
    GET  /v1/recent-failures?limit=N     {"failures": [...]}: the last runs that were not ok, newest first

A run beyond the pool's bounded queue (`max_queued`) and a session open that finds no slot are both
answered 503 + Retry-After: full, not broken. Session ids name the instance (`NAME~s<hex>`, the
pool's `instance_name`). Every request the caller got wrong is a 4xx
`{"error": {"message", "type", "field"}}` naming the bad value. Code and stdin travel as UTF-8 text,
files as base64; a file path is relative to the working directory or absolute under one of the run's
writable roots (`paths.py`), as in SandboxFusion. The pool knows nothing of HTTP and this module
knows nothing of isolation; it validates, converts and counts.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from tether.errors import ConfigError, TetherError, describe_validation_error
from tether.sandbox.failures import RecentFailure, RecentFailures
from tether.sandbox.fusion import FusionRunRequest, FusionRunResponse, FusionRunStatus, to_fusion
from tether.sandbox.languages import lookup
from tether.sandbox.metrics import ServerMetrics
from tether.sandbox.pool import NoFreeSlot, PoolConfig, SandboxPool
from tether.sandbox.result import RunResult
from tether.sandbox.session import SessionClosed
from tether.sandbox.spec import SandboxSpec, UnicodeText, sandbox_path
from tether.web import AsciiJSONResponse

# SandboxFusion language name -> tether language name. Their other languages are refused by name.
FUSION_LANGUAGES = {"python": "python", "cpp": "cpp", "nodejs": "javascript", "bash": "bash", "c": "c"}


class ApiError(Exception):
    """A request the caller got wrong (or a thing it named that does not exist): becomes a 4xx."""

    def __init__(self, status: int, message: str, kind: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.field = status, message, kind, field


def error_response(status: int, message: str, kind: str, field: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "field": field}}
    return AsciiJSONResponse(body, status_code=status)


# ---- native schema -------------------------------------------------------------------------------------


class SessionRunBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: UnicodeText = Field(description="Program source, UTF-8 text.")
    language: UnicodeText = Field("python", description="python, bash, c, cpp or javascript (or an alias).")
    stdin: UnicodeText = Field("", description="Standard input, UTF-8 text.")
    files: dict[UnicodeText, str] = Field(
        default_factory=dict, description="Path (relative, or under /tmp, /mnt, ...) -> base64 content."
    )
    collect: list[UnicodeText] = Field(
        default_factory=list,
        description="Paths (relative, or under /tmp, /mnt, ...) to return after the run.",
    )
    spec: dict[str, Any] | None = Field(None, description="SandboxSpec fields overriding the pool's spec.")


class RunBody(SessionRunBody):
    warm: bool = Field(True, description="Run Python in a forked, preloaded interpreter.")
    client: UnicodeText = Field("", description="Fair-queue identity: clients are served round-robin.")


class SessionOpenBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spec: dict[str, Any] | None = None


class UploadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    files: dict[UnicodeText, str] = Field(
        description="Path (relative, or under /tmp, /mnt, ...) -> base64 content."
    )


# ---- validation helpers (pure) -------------------------------------------------------------------------


def check_path(path: str, field: str, workdir: str) -> str:
    """A file path must name something a run may write: relative to its workdir or under a writable root."""
    try:
        return sandbox_path(path, field, workdir)
    except ConfigError as error:
        raise ApiError(422, str(error), "invalid_path", field) from None


def decode_files(files: Mapping[str, str | None], field: str, workdir: str) -> dict[str, bytes]:
    """Base64 values to bytes, naming the first bad entry. `None` values are skipped (SandboxFusion does)."""
    decoded = {}
    for path, content in files.items():
        check_path(path, field, workdir)
        if content is None:
            continue
        try:
            decoded[path] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError) as error:
            raise ApiError(
                422, f"{field}[{path!r}] is not valid base64: {error}", "invalid_base64", f"{field}.{path}"
            ) from None
    return decoded


def override_spec(base: SandboxSpec, overrides: Mapping[str, Any] | None, field: str = "spec") -> SandboxSpec:
    if not overrides:
        return base
    try:
        return SandboxSpec.model_validate({**base.model_dump(), **overrides})
    except ValidationError as error:
        problem = error.errors()[0]
        first = ".".join(str(part) for part in problem["loc"])
        message = describe_validation_error(error, field)
        if problem["type"] == "invalid_text":
            raise ApiError(400, message, "invalid_text", f"{field}.{first}") from None
        raise ApiError(422, message, "invalid_spec", f"{field}.{first}") from None


def fusion_spec(base: SandboxSpec, body: FusionRunRequest) -> SandboxSpec:
    """The pool's spec with SandboxFusion's limits; errors name their fields. Memory <= 0 keeps ours."""
    names = {
        "timeout_s": "run_timeout",
        "compile_timeout_s": "compile_timeout",
        "memory_mib": "memory_limit_MB",
    }
    overrides: dict[str, Any] = {"timeout_s": body.run_timeout, "compile_timeout_s": body.compile_timeout}
    if body.memory_limit_MB > 0:
        overrides["memory_mib"] = body.memory_limit_MB
    try:
        return SandboxSpec.model_validate({**base.model_dump(), **overrides})
    except ValidationError as error:
        problems = [(names.get(str(p["loc"][0]), str(p["loc"][0])), p) for p in error.errors()]
        message = "; ".join(f"{name} = {p['input']!r}: {p['msg']}" for name, p in problems)
        raise ApiError(422, message, "invalid_value", problems[0][0]) from None


def describe_request_problems(problems: Sequence[Any]) -> tuple[str, str | None]:
    """FastAPI's validation errors as one readable message, and the first bad field."""
    lines, fields = [], []
    for problem in problems:
        parts = [str(part) for part in problem.get("loc", ()) if part != "body"]
        field = ".".join(parts) or "(body)"
        fields.append(field)
        kind = problem.get("type")
        if kind == "extra_forbidden":
            lines.append(f"unknown field {field!r}")
        elif kind == "missing":
            lines.append(f"{field}: required field is missing")
        else:
            shown = repr(problem.get("input"))
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            lines.append(f"{field} = {shown}: {problem.get('msg')}")
    return "; ".join(lines), fields[0] if fields else None


# ---- the app -------------------------------------------------------------------------------------------


def create_app(pool: SandboxPool, *, manage_pool: bool = False, health_timeout_s: float = 30.0) -> FastAPI:
    """The HTTP API over `pool`.

    With `manage_pool=False` (the default) the caller starts and closes the pool, as tests and
    embedders do; with `manage_pool=True` the app's lifespan starts it on startup and closes it on
    shutdown, which is what `serve` uses (the pool must live in the server's event loop).
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not manage_pool:
            yield
            return
        async with pool:
            yield

    app = FastAPI(title="tether sandbox", lifespan=lifespan)
    metrics = ServerMetrics(pool)
    failures = RecentFailures()
    pod_name = os.environ.get("MY_POD_NAME")
    workdir = pool.config.workdir
    app.state.pool, app.state.metrics = pool, metrics

    def canonical(language: str) -> str:
        try:
            return lookup(pool.languages, language).name
        except ConfigError as error:
            raise ApiError(422, str(error), "unsupported_language", "language") from None

    async def timed(language: str, run: Awaitable[RunResult]) -> RunResult:
        started = time.perf_counter()
        result = await run
        metrics.observe(language, result, time.perf_counter() - started)
        failures.note(language, result, time.time())
        return result

    @app.exception_handler(ApiError)
    async def on_api_error(_: Request, error: ApiError) -> JSONResponse:
        return error_response(error.status, error.message, error.kind, error.field)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = list(error.errors())
        bad_json = next((p for p in problems if p.get("type") == "json_invalid"), None)
        if bad_json is not None:
            reason = bad_json.get("ctx", {}).get("error", "malformed JSON")
            return error_response(400, f"request body is not valid JSON: {reason}", "invalid_json")
        if any(tuple(p.get("loc", ())) == ("body",) and p.get("type") != "missing" for p in problems):
            sent = request.headers.get("content-type", "none")
            message = f"request body must be a JSON object sent as application/json (content-type: {sent})"
            return error_response(400, message, "invalid_json")
        # Text that cannot be UTF-8 is a malformed body, like bad JSON, rather than a wrong value.
        text = [p for p in problems if p.get("type") == "invalid_text"]
        if text:
            message, field = describe_request_problems(text)
            return error_response(400, message, "invalid_text", field)
        message, field = describe_request_problems(problems)
        return error_response(422, message, "validation_error", field)

    @app.exception_handler(SessionClosed)
    async def on_session_closed(_: Request, error: SessionClosed) -> JSONResponse:
        return error_response(404, str(error), "session_not_found", "id")

    @app.exception_handler(NoFreeSlot)
    async def on_no_free_slot(_: Request, error: NoFreeSlot) -> JSONResponse:
        response = error_response(503, str(error), "no_free_slot")
        response.headers["Retry-After"] = str(error.retry_after_s)
        return response

    @app.exception_handler(ConfigError)
    async def on_config_error(_: Request, error: ConfigError) -> JSONResponse:
        return error_response(422, str(error), "invalid_value")

    @app.exception_handler(TetherError)
    async def on_tether_error(_: Request, error: TetherError) -> JSONResponse:
        return error_response(500, str(error), "sandbox_error")

    @app.exception_handler(HTTPException)
    async def on_http(_: Request, error: HTTPException) -> JSONResponse:
        # FastAPI turns any failure of its JSON parser other than a syntax error into this 400.
        if isinstance(error.__cause__, RecursionError):
            message = "request body is not valid JSON: it is nested too deeply to parse"
            return error_response(400, message, "invalid_json")
        if isinstance(error.__cause__, UnicodeDecodeError):
            message = f"request body is not valid JSON: it is not UTF-8 text ({error.__cause__.reason})"
            return error_response(400, message, "invalid_json")
        return error_response(error.status_code, str(error.detail), "http_error")

    @app.post("/run_code", response_model=FusionRunResponse, tags=["sandboxfusion"])
    async def run_code(body: FusionRunRequest) -> FusionRunResponse:
        accepted = sorted(name for name, ours in FUSION_LANGUAGES.items() if ours in pool.languages)
        if body.language not in accepted:
            raise ApiError(
                422,
                f"language {body.language!r} is not supported; accepted: {', '.join(accepted)}",
                "unsupported_language",
                "language",
            )
        language = FUSION_LANGUAGES[body.language]
        spec = fusion_spec(pool.spec, body)
        files = decode_files(body.files, "files", workdir)
        fetch = [check_path(path, "fetch_files", workdir) for path in body.fetch_files]
        try:
            result = await timed(
                language, pool.run(body.code, language, body.stdin or "", files, fetch, spec=spec)
            )
        except Exception as error:  # SandboxFusion answers its own failures as SandboxError, not 5xx
            message = f"exception on running code: {type(error).__name__}: {error}"
            return FusionRunResponse(
                status=FusionRunStatus.SANDBOX_ERROR, message=message, executor_pod_name=pod_name
            )
        return to_fusion(result, pod_name)

    @app.post("/v1/run", response_model=RunResult, tags=["native"])
    async def run(body: RunBody) -> RunResult:
        language = canonical(body.language)
        spec = override_spec(pool.spec, body.spec)
        files = decode_files(body.files, "files", workdir)
        collect = [check_path(path, "collect", workdir) for path in body.collect]
        return await timed(
            language,
            pool.run(
                body.code, language, body.stdin, files, collect, spec, client=body.client, warm=body.warm
            ),
        )

    @app.post("/v1/sessions", status_code=201, tags=["native"])
    async def open_session(body: SessionOpenBody | None = None) -> dict[str, str]:
        spec = override_spec(pool.spec, body.spec if body else None)
        session = await pool.open_session(spec)
        return {"id": session.id}

    @app.post("/v1/sessions/{session_id}/run", response_model=RunResult, tags=["native"])
    async def session_run(session_id: str, body: SessionRunBody) -> RunResult:
        language = canonical(body.language)
        files = decode_files(body.files, "files", workdir)
        collect = [check_path(path, "collect", workdir) for path in body.collect]
        session = pool.get_session(session_id)
        spec = override_spec(session.spec, body.spec)
        return await timed(language, session.run(body.code, language, body.stdin, files, collect, spec))

    @app.put("/v1/sessions/{session_id}/files", status_code=204, tags=["native"])
    async def upload(session_id: str, body: UploadBody) -> Response:
        files = decode_files(body.files, "files", workdir)
        await pool.get_session(session_id).upload(files)
        return Response(status_code=204)

    @app.get("/v1/sessions/{session_id}/files", tags=["native"])
    async def download(session_id: str, path: list[str] = Query(min_length=1)) -> dict[str, dict[str, str]]:
        paths = [check_path(p, "path", workdir) for p in path]
        try:
            files = await pool.get_session(session_id).download(paths)
        except FileNotFoundError as error:
            raise ApiError(404, str(error), "file_not_found", "path") from None
        return {"files": {name: base64.b64encode(data).decode("ascii") for name, data in files.items()}}

    @app.delete("/v1/sessions/{session_id}", status_code=204, tags=["native"])
    async def close_session(session_id: str) -> Response:
        await pool.get_session(session_id).close()
        return Response(status_code=204)

    def slot_usage() -> dict[str, int]:
        sessions = len(pool.sessions)
        return {
            "slots": pool.config.slots,
            "open_sessions": sessions,
            "running": pool.busy_slots - sessions,
            "queue_depth": pool.queue_depth,
        }

    @app.get("/v1/load", tags=["ops"])
    async def load() -> dict[str, Any]:
        return {
            "instance": pool.config.instance_name,
            "slots": pool.config.slots,
            "busy": pool.busy_slots,
            "queue_depth": pool.queue_depth,
            "max_queued": pool.config.max_queued,
            "open_sessions": len(pool.sessions),
            "warm": pool.warm_workers,
        }

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> JSONResponse:
        usage = slot_usage()
        if usage["open_sessions"] >= usage["slots"]:
            # A health run would wait for a slot that only a session's close frees: say so at once.
            reasons = [f"every slot is held by an open session ({pool.describe_slots()})"]
            full = JSONResponse({"status": "full", "reasons": reasons, **usage}, status_code=503)
            full.headers["Retry-After"] = "1"
            return full
        try:
            report = await asyncio.wait_for(pool.health(), health_timeout_s)
        except TimeoutError:
            reasons = [f"no health run finished within {health_timeout_s:g} s ({pool.describe_slots()})"]
            return JSONResponse({"status": "unhealthy", "reasons": reasons, **slot_usage()}, status_code=503)
        if report.passed:
            return JSONResponse({"status": "ok", **slot_usage()})
        reasons = report.reasons or ["the health run did not print 'ok' and exit cleanly"]
        return JSONResponse({"status": "unhealthy", "reasons": reasons, **slot_usage()}, status_code=503)

    @app.get("/v1/recent-failures", tags=["ops"])
    async def recent_failures(limit: int = Query(20, ge=1, le=100)) -> dict[str, list[RecentFailure]]:
        return {"failures": failures.latest(limit)}

    @app.get("/metrics", tags=["ops"])
    async def metrics_text() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(host: str, port: int, spec: SandboxSpec, config: PoolConfig) -> None:
    """Run the API with uvicorn until interrupted; the pool starts with the server and closes with it.

    A pool without an instance name takes `$MY_POD_NAME` (Kubernetes), else `HOST:PORT` (the machine's
    host name when bound to every address)."""
    if not config.instance_name:
        address = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
        name = os.environ.get("MY_POD_NAME") or f"{address}:{port}"
        config = dataclasses.replace(config, instance_name=name)
    app = create_app(SandboxPool(spec, config), manage_pool=True)
    uvicorn.run(app, host=host, port=port, lifespan="on", log_level="info")
