"""An OpenAI-compatible HTTP API over an `AsyncEngine`: chat and text completions (streamed as SSE or
whole; chat with tools, tool calls and structured output), the model list, health and Prometheus metrics.

Tokenization happens here, never in the engine. Only one model is served, and only what the engine can
do: no penalties, no logit bias. Requests become jobs in `jobs.py`, bodies are written by
`responses.py` and `streaming.py`; this module runs jobs and routes HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException
from transformers import PreTrainedTokenizerBase

from tether.engine.async_engine import (
    AsyncEngine,
    EngineOverloadedError,
    EngineStoppedError,
    RequestDelta,
)
from tether.errors import TetherError
from tether.serving.jobs import Job, JobFactory
from tether.serving.metrics import (
    EngineCollector,
    RequestStatus,
    ServerMetrics,
)
from tether.serving.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    route_error,
    validation_error,
)
from tether.serving.responses import Choice, ResponseWriter, alternatives_of
from tether.serving.streaming import sse

logger = logging.getLogger(__name__)
T = TypeVar("T")


class _Server:
    """The request handling behind `create_app`; one instance per app."""

    def __init__(self, engine: AsyncEngine, tokenizer: PreTrainedTokenizerBase, model_name: str) -> None:
        self.engine = engine
        vocab_size = min(len(tokenizer), engine.engine.vocab_size)
        self.jobs = JobFactory(tokenizer, model_name, vocab_size, engine.engine.config.max_model_len)
        self.writer = ResponseWriter(tokenizer)
        self.metrics = ServerMetrics()
        self.metrics.registry.register(EngineCollector(engine))

    # running

    async def deltas(self, job: Job, every_step: bool = True) -> AsyncGenerator[RequestDelta, None]:
        """The engine's deltas (`every_step` False: the first, and then the last; `AsyncEngine.generate`),
        with metrics; records the request's final status."""
        status = RequestStatus.ABORTED
        first_s = None
        most_tokens = 0
        try:
            async with contextlib.aclosing(
                self.engine.generate(job.prompt_token_ids, job.params, job.priority, every_step=every_step)
            ) as stream:
                async for delta in stream:
                    tokens = sum(len(c.token_ids) for c in delta.completions)
                    if tokens and first_s is None:
                        first_s = time.monotonic()
                        self.metrics.time_to_first_token.observe(first_s - job.arrived_s)
                    self.metrics.generated_tokens.inc(tokens)
                    most_tokens += max((len(c.token_ids) for c in delta.completions), default=0)
                    if delta.finished:  # before yielding: the consumer may stop at the last delta
                        status = RequestStatus.COMPLETED
                    yield delta
        except EngineOverloadedError:
            status = RequestStatus.OVERLOADED
            raise
        except Exception:
            status = RequestStatus.FAILED
            raise
        finally:
            self.metrics.requests.labels(status.value).inc()
            if status is RequestStatus.COMPLETED and first_s is not None and most_tokens > 1:
                self.metrics.time_per_output_token.observe((time.monotonic() - first_s) / (most_tokens - 1))

    async def start(
        self, job: Job, every_step: bool = True
    ) -> tuple[RequestDelta, AsyncGenerator[RequestDelta, None]]:
        """Submit and wait for the first delta, so that refusals become HTTP errors, not broken streams."""
        stream = self.deltas(job, every_step)
        try:
            first = await anext(stream)
        except EngineOverloadedError as error:
            raise APIError(503, str(error), None, "engine_overloaded", "server_error") from None
        except EngineStoppedError as error:
            raise APIError(503, str(error), None, "engine_stopped", "server_error") from None
        except TetherError as error:  # the engine refused the request (RequestError and the like)
            raise APIError(400, str(error)) from None
        return first, stream

    async def complete(self, job: Job) -> dict[str, Any]:
        """The whole response, once every sample finished (from the first delta and the last only)."""
        first, stream = await self.start(job, every_step=False)
        choices = [Choice() for _ in range(job.params.n)]
        async with contextlib.aclosing(stream):
            delta: RequestDelta | None = first
            while delta is not None:
                for completion in delta.completions:
                    choice = choices[completion.index]
                    choice.token_ids += completion.token_ids
                    choice.logprobs += completion.logprobs
                    choice.alternatives += alternatives_of(completion)
                    choice.text += completion.text
                    if completion.finish_reason is not None:
                        choice.finish_reason = completion.finish_reason.value
                if delta.finished:
                    break
                delta = await anext(stream, None)
        if delta is None:
            raise EngineStoppedError("the request ended without finishing")
        response = self.writer.envelope(job, chunk=False)
        response["choices"] = [self.writer.choice(job, i, choice) for i, choice in enumerate(choices)]
        response["usage"] = self.writer.usage(job, delta, choices)
        return response


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the client disconnects first: `work` is then cancelled, which aborts
    its request in the engine. Streams also stop when a send fails; this covers the wait before one."""

    async def until_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


def create_app(async_engine: AsyncEngine, tokenizer: PreTrainedTokenizerBase, model_name: str) -> FastAPI:
    """The HTTP app; the caller starts and shuts down `async_engine`."""
    server = _Server(async_engine, tokenizer, model_name)
    app = FastAPI(title="tether", summary="OpenAI-compatible inference over tether's engine")
    app.state.server = server

    schemas: dict[str, type[GenerationRequest]] = {
        "/v1/chat/completions": ChatCompletionRequest,
        "/v1/completions": CompletionRequest,
    }

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> Response:
        if error.status < 500:  # refusals for load or a stopped engine are counted where they happen
            server.metrics.requests.labels(RequestStatus.REJECTED.value).inc()
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> Response:
        server.metrics.requests.labels(RequestStatus.REJECTED.value).inc()
        return validation_error(error, schemas.get(request.url.path)).response()

    @app.exception_handler(HTTPException)
    async def refused(request: Request, error: HTTPException) -> Response:
        endpoints = [
            f"{method} {route.path}"
            for route in app.routes
            if isinstance(route, APIRoute)
            for method in sorted(route.methods or ())
        ]
        refusal = route_error(
            request.method, request.url.path, error.status_code, error.detail, error.__cause__, endpoints
        )
        return refusal.response()

    async def respond(job: Job, request: Request) -> Response:
        gone = Response(status_code=499)  # nginx's "client closed request": nobody reads it
        if not job.stream:
            response = await _unless_disconnected(request, server.complete(job))
            return gone if response is None else JSONResponse(response)
        started = await _unless_disconnected(request, server.start(job))
        if started is None:
            return gone
        return StreamingResponse(
            sse(server.writer, job, *started),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await respond(server.jobs.chat(body), request)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await respond(server.jobs.text(body), request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        limit = async_engine.engine.config.max_model_len
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tether",
            "max_model_len": limit,
        }
        return {"object": "list", "data": [card]}

    @app.get("/healthz", response_model=None)
    async def healthz() -> Response:
        if not async_engine.is_running:
            return JSONResponse({"status": "stopped", "error": repr(async_engine.error)}, status_code=503)
        return JSONResponse({"status": "ok", "pending_requests": async_engine.num_pending})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type="text/plain; version=0.0.4")

    return app
