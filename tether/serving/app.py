"""An OpenAI-compatible HTTP API over an `AsyncEngine`: chat and text completions (streamed as SSE or
whole), the model list, health and Prometheus metrics.

Tokenization happens here, never in the engine. Only one model is served, and only what the engine
can do: no tools, no penalties, no alternative tokens in logprobs (`top_logprobs` must be 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

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
from tether.engine.sampling import SamplingParams
from tether.errors import ConfigError, TetherError
from tether.serving.metrics import (
    EngineCollector,
    RequestStatus,
    ServerMetrics,
)
from tether.serving.openai_api import (
    SAMPLING_FIELD,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    route_error,
    validation_error,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

# one generation, from validated request to deltas


@dataclass(slots=True)
class _Job:
    kind: Literal["chat", "text"]
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    stream: bool
    include_usage: bool
    logprobs: bool
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    arrived_s: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _Choice:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


class _Server:
    """The request handling behind `create_app`; one instance per app."""

    def __init__(self, engine: AsyncEngine, tokenizer: PreTrainedTokenizerBase, model_name: str) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = min(len(tokenizer), engine.engine.runner.model.config.vocab_size)
        self.metrics = ServerMetrics()
        self.metrics.registry.register(EngineCollector(engine))

    # validation

    def chat_job(self, body: ChatCompletionRequest) -> _Job:
        if body.top_logprobs:
            raise APIError(400, f"top_logprobs = {body.top_logprobs}: only 0 is supported", "top_logprobs")
        messages = [message.as_template_input() for message in body.messages]
        try:
            ids: Any = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as error:
            raise APIError(400, f"messages: cannot apply the chat template: {error}", "messages") from error
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        return self._job("chat", body, [int(i) for i in ids], max_tokens, param, body.logprobs)

    def text_job(self, body: CompletionRequest) -> _Job:
        if body.logprobs:
            raise APIError(
                400, f"logprobs = {body.logprobs}: only 0 (no alternatives) is supported", "logprobs"
            )
        if body.echo:
            raise APIError(400, "echo = true is not supported", "echo")
        if isinstance(body.prompt, str):
            ids = list(self.tokenizer.encode(body.prompt))
        else:
            ids = body.prompt
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"prompt: token ids {bad[:5]} out of range: expected 0 to {self.vocab_size - 1}",
                    "prompt",
                )
        return self._job("text", body, ids, body.max_tokens, "max_tokens", body.logprobs is not None)

    def _job(
        self,
        kind: Literal["chat", "text"],
        body: GenerationRequest,
        ids: list[int],
        max_tokens: int | None,
        max_tokens_param: str,
        logprobs: bool,
    ) -> _Job:
        if body.model != self.model_name:
            raise APIError(
                404,
                f"The model `{body.model}` does not exist; this server serves `{self.model_name}`.",
                "model",
                "model_not_found",
            )
        prompt_param = "messages" if kind == "chat" else "prompt"
        limit = self.engine.engine.config.max_model_len
        if not ids:
            raise APIError(400, f"{prompt_param}: the prompt is empty", prompt_param)
        if len(ids) >= limit or (max_tokens is not None and len(ids) + max_tokens > limit):
            requested = f"{len(ids)} in the prompt" + (f", {max_tokens} to generate" if max_tokens else "")
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; you requested {requested}.",
                prompt_param,
                "context_length_exceeded",
            )
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        try:
            params = SamplingParams(
                max_tokens=limit - len(ids) if max_tokens is None else max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                min_p=body.min_p,
                seed=body.seed,
                n=body.n,
                stop=stop,
                ignore_eos=body.ignore_eos,
            )
        except ConfigError as error:
            match = SAMPLING_FIELD.match(str(error))
            param = match.group(1) if match else None
            message = str(error).removeprefix("sampling: ")
            if param == "max_tokens":  # name the field the client sent
                param, message = max_tokens_param, message.replace("max_tokens", max_tokens_param, 1)
            raise APIError(400, message, param) from None
        return _Job(
            kind,
            ids,
            params,
            body.priority,
            body.stream,
            body.stream_options is not None and body.stream_options.include_usage,
            logprobs,
            self.model_name,
        )

    # running

    async def deltas(self, job: _Job) -> AsyncGenerator[RequestDelta, None]:
        """The engine's deltas, with metrics; records the request's final status."""
        status = RequestStatus.ABORTED
        first_s = None
        most_tokens = 0
        try:
            async with contextlib.aclosing(
                self.engine.generate(job.prompt_token_ids, job.params, job.priority)
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

    async def start(self, job: _Job) -> tuple[RequestDelta, AsyncGenerator[RequestDelta, None]]:
        """Submit and wait for the first delta, so that refusals become HTTP errors, not broken streams."""
        stream = self.deltas(job)
        try:
            first = await anext(stream)
        except EngineOverloadedError as error:
            raise APIError(503, str(error), None, "engine_overloaded", "server_error") from None
        except EngineStoppedError as error:
            raise APIError(503, str(error), None, "engine_stopped", "server_error") from None
        except TetherError as error:  # the engine refused the request (RequestError and the like)
            raise APIError(400, str(error)) from None
        return first, stream

    def usage(self, job: _Job, delta: RequestDelta, choices: list[_Choice]) -> dict[str, Any]:
        completion_tokens = sum(len(choice.token_ids) for choice in choices)
        return {
            "prompt_tokens": len(job.prompt_token_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(job.prompt_token_ids) + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": delta.num_cached_tokens},
        }

    def logprobs(self, job: _Job, token_ids: list[int] | tuple[int, ...], values: Any) -> Any:
        if not job.logprobs:
            return None
        texts = [str(self.tokenizer.decode([token])) for token in token_ids]
        if job.kind == "chat":
            return {
                "content": [
                    {"token": text, "logprob": value, "bytes": list(text.encode()), "top_logprobs": []}
                    for text, value in zip(texts, values, strict=True)
                ]
            }
        return {"tokens": texts, "token_logprobs": list(values), "top_logprobs": None, "text_offset": None}

    def envelope(self, job: _Job, chunk: bool) -> dict[str, Any]:
        if job.kind == "chat":
            request_id, kind = f"chatcmpl-{job.id}", "chat.completion.chunk" if chunk else "chat.completion"
        else:
            request_id, kind = f"cmpl-{job.id}", "text_completion"
        return {
            "id": request_id,
            "object": kind,
            "created": job.created,
            "model": job.model,
            "system_fingerprint": None,
        }

    async def complete(self, job: _Job) -> dict[str, Any]:
        """The whole response, once every sample finished."""
        first, stream = await self.start(job)
        choices = [_Choice() for _ in range(job.params.n)]
        async with contextlib.aclosing(stream):
            delta: RequestDelta | None = first
            while delta is not None:
                for completion in delta.completions:
                    choice = choices[completion.index]
                    choice.token_ids += completion.token_ids
                    choice.logprobs += completion.logprobs
                    choice.text += completion.text
                    if completion.finish_reason is not None:
                        choice.finish_reason = completion.finish_reason.value
                if delta.finished:
                    break
                delta = await anext(stream, None)
        if delta is None:
            raise EngineStoppedError("the request ended without finishing")
        response = self.envelope(job, chunk=False)
        response["choices"] = [self.choice(job, index, choice) for index, choice in enumerate(choices)]
        response["usage"] = self.usage(job, delta, choices)
        return response

    def choice(self, job: _Job, index: int, choice: _Choice) -> dict[str, Any]:
        logprobs = self.logprobs(job, choice.token_ids, choice.logprobs)
        reason = choice.finish_reason
        if job.kind == "chat":
            message = {"role": "assistant", "content": choice.text, "refusal": None}
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
        return {"index": index, "text": choice.text, "logprobs": logprobs, "finish_reason": reason}

    async def sse(
        self, job: _Job, first: RequestDelta, stream: AsyncGenerator[RequestDelta, None]
    ) -> AsyncGenerator[str, None]:
        """Server-sent events: one chunk per sample that changed, then usage if asked, then [DONE]."""
        choices = [_Choice() for _ in range(job.params.n)]
        usage: dict[str, Any] = {"usage": None} if job.include_usage else {}

        def event(payload: dict[str, Any]) -> str:
            return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

        def chunk(body: dict[str, Any]) -> str:
            return event({**self.envelope(job, chunk=True), "choices": [body], **usage})

        if job.kind == "chat":
            for index in range(job.params.n):
                role = {"role": "assistant", "content": ""}
                yield chunk({"index": index, "delta": role, "logprobs": None, "finish_reason": None})
        last = first
        try:
            async with contextlib.aclosing(stream):
                delta: RequestDelta | None = first
                while delta is not None:
                    last = delta
                    for completion in delta.completions:
                        choices[completion.index].token_ids += completion.token_ids
                        reason = completion.finish_reason.value if completion.finish_reason else None
                        if not (completion.text or reason or job.logprobs):
                            continue
                        body: dict[str, Any] = {"index": completion.index}
                        if job.kind == "chat":
                            body["delta"] = {"content": completion.text} if completion.text else {}
                        else:
                            body["text"] = completion.text
                        body["logprobs"] = self.logprobs(job, completion.token_ids, completion.logprobs)
                        body["finish_reason"] = reason
                        yield chunk(body)
                    if delta.finished:
                        break
                    delta = await anext(stream, None)
        except Exception as error:
            logger.exception("stream %s failed", job.id)
            yield event(
                {"error": {"message": str(error), "type": "server_error", "param": None, "code": None}}
            )
            return
        if job.include_usage:
            final = {**self.envelope(job, chunk=True), "choices": [], "usage": self.usage(job, last, choices)}
            yield event(final)
        yield "data: [DONE]\n\n"


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

    async def respond(job: _Job, request: Request) -> Response:
        gone = Response(status_code=499)  # nginx's "client closed request": nobody reads it
        if not job.stream:
            response = await _unless_disconnected(request, server.complete(job))
            return gone if response is None else JSONResponse(response)
        started = await _unless_disconnected(request, server.start(job))
        if started is None:
            return gone
        return StreamingResponse(
            server.sse(job, *started),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await respond(server.chat_job(body), request)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await respond(server.text_job(body), request)

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
