"""Server-sent events of a job: OpenAI's chunks, with a chat reply's tool calls as `delta.tool_calls`.

Prose before a call streams as content at once; a call streams as one `tool_calls` entry (index, id,
type, name and the whole arguments) once its block closed, so no `<tool_call>` tag ever reaches
content, and a block that turns out malformed streams as the content it was. Whitespace that only
separates blocks is not sent.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator
from typing import Any

from tether.chat import FinishReason, JsonDict
from tether.chat.tool_format import ContentDelta, MalformedCall, StreamEvent, ToolCallStream
from tether.engine.async_engine import RequestDelta
from tether.serving.jobs import Job
from tether.serving.responses import Choice, ResponseWriter, call_id, tool_call_entry

logger = logging.getLogger(__name__)


class ChoiceStream:
    """One sample's text deltas as OpenAI `delta` objects."""

    def __init__(self, job: Job) -> None:
        self.parser: ToolCallStream | None = job.tool_format.stream(call_id) if job.reads_calls else None
        self.calls = 0
        self.spoken = False  # content went out: later whitespace may matter
        self.pending = ""  # whitespace not yet known to be more than a separator

    def feed(self, text: str) -> list[JsonDict]:
        if self.parser is None:
            return [{"content": text}] if text else []
        return self._deltas(self.parser.feed(text))

    def finish(self) -> list[JsonDict]:
        return [] if self.parser is None else self._deltas(self.parser.finish())

    def finish_reason(self, reason: str | None) -> str | None:
        return FinishReason.TOOL_CALLS.value if reason is not None and self.calls else reason

    def _deltas(self, events: list[StreamEvent]) -> list[JsonDict]:
        deltas: list[JsonDict] = []
        for event in events:
            if isinstance(event, ContentDelta):
                deltas += self._content(event.text)
            elif isinstance(event.block, MalformedCall):
                deltas += self._content(event.block.raw)
            else:
                call = event.block
                entry = tool_call_entry(self.calls, call.id, call.name, call.arguments)
                deltas.append({"tool_calls": [entry]})
                self.calls += 1
        return deltas

    def _content(self, text: str) -> list[JsonDict]:
        """Prose, less the whitespace that may only separate it from a call (the whole reply's content
        is stripped): trailing whitespace waits until more prose follows."""
        body = text.rstrip()
        if not body:
            self.pending += text
            return []
        start = self.pending + body if self.spoken else body.lstrip()
        self.pending, self.spoken = text[len(body) :], True
        return [{"content": start}]


async def sse(
    writer: ResponseWriter, job: Job, first: RequestDelta, stream: AsyncGenerator[RequestDelta, None]
) -> AsyncGenerator[str, None]:
    """One chunk per change of a sample (its logprobs ride on the first), then usage if asked, then
    [DONE]; a failure mid-stream is an error event, as the status line went out already."""
    choices = [Choice() for _ in range(job.params.n)]
    texts = [ChoiceStream(job) for _ in range(job.params.n)]
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


def _bodies(writer: ResponseWriter, job: Job, text: ChoiceStream, completion: Any) -> list[JsonDict]:
    """The chunk bodies one sample's delta makes: its text (content and calls), logprobs, finish."""
    reason = completion.finish_reason.value if completion.finish_reason else None
    if job.kind == "text":
        if not (completion.text or reason or job.logprobs):
            return []
        logprobs = writer.logprobs(job, completion.token_ids, completion.logprobs)
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
    bodies = [
        {"index": completion.index, "delta": delta, "logprobs": None, "finish_reason": None}
        for delta in deltas
    ]
    if bodies and job.logprobs:
        bodies[0]["logprobs"] = writer.logprobs(job, completion.token_ids, completion.logprobs)
    if bodies:
        bodies[-1]["finish_reason"] = text.finish_reason(reason)
    return bodies
