"""Server-sent events of a job: OpenAI's chunks, a chat reply's tool calls as `delta.tool_calls`
(read by `replies.ReplyReader`, as the whole response's are), then usage if asked, then [DONE]."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator
from typing import Any

from tether.chat import JsonDict
from tether.engine.async_engine import CompletionDelta, RequestDelta
from tether.serving.jobs import Job
from tether.serving.replies import ReplyReader
from tether.serving.responses import Choice, ResponseWriter, alternatives_of

logger = logging.getLogger(__name__)


async def sse(
    writer: ResponseWriter, job: Job, first: RequestDelta, stream: AsyncGenerator[RequestDelta, None]
) -> AsyncGenerator[str, None]:
    """One chunk per change of a sample (its logprobs ride on the first), then usage if asked, then
    [DONE]; a failure mid-stream is an error event, as the status line went out already."""
    choices = [Choice() for _ in range(job.params.n)]
    texts = [ReplyReader(job) for _ in range(job.params.n)]
    usage: dict[str, Any] = {"usage": None} if job.include_usage else {}

    def event(payload: JsonDict) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def chunk(body: JsonDict) -> str:
        return event({**writer.envelope(job, chunk=True), "choices": [body], **usage})

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
                    if texts[completion.index].finished:  # repeated while other samples go on
                        continue
                    choices[completion.index].token_ids += completion.token_ids
                    for body in _bodies(writer, job, texts[completion.index], completion):
                        yield chunk(body)
                if delta.finished:
                    break
                delta = await anext(stream, None)
    except Exception as error:
        logger.exception("stream %s failed", job.id)
        yield event({"error": {"message": str(error), "type": "server_error", "param": None, "code": None}})
        return
    if job.include_usage:
        final = {**writer.envelope(job, chunk=True), "choices": [], "usage": writer.usage(job, last, choices)}
        yield event(final)
    yield "data: [DONE]\n\n"


def _bodies(
    writer: ResponseWriter, job: Job, text: ReplyReader, completion: CompletionDelta
) -> list[JsonDict]:
    """The chunk bodies one sample's delta makes: its text (content and calls), logprobs, finish."""
    reason = completion.finish_reason.value if completion.finish_reason else None
    if job.kind == "text":
        if reason is not None:
            text.finish()
        if not (completion.text or reason or job.logprobs):
            return []
        logprobs = writer.logprobs(
            job, completion.token_ids, completion.logprobs, alternatives_of(completion)
        )
        return [
            {
                "index": completion.index,
                "text": completion.text,
                "logprobs": logprobs,
                "finish_reason": reason,
            }
        ]
    deltas = text.feed(completion.text) + (text.finish() if reason is not None else [])
    if not deltas and (reason is not None or (job.logprobs and completion.token_ids)):
        deltas = [{}]
    bodies: list[JsonDict] = [
        {"index": completion.index, "delta": delta, "logprobs": None, "finish_reason": None}
        for delta in deltas
    ]
    if bodies and job.logprobs:
        bodies[0]["logprobs"] = writer.logprobs(
            job, completion.token_ids, completion.logprobs, alternatives_of(completion)
        )
    if bodies:
        bodies[-1]["finish_reason"] = text.finish_reason(reason)
    return bodies
