"""A chat reply's text as OpenAI reads it: prose as content, each well-formed tool-call block as a
`tool_calls` entry, whether it arrives in deltas (`ReplyReader`) or whole (`assistant_reply`, which reads
it the same way, so a streamed reply and a whole one never differ).

A call comes out once its block closed, as one entry (index, id, type, name and the whole arguments),
so no tag of a well-formed call reaches content. A block that is not a well-formed call goes back as the
content it was, in its place (the client sees what the model wrote; never a server error). Whitespace
that only separates prose from blocks is dropped, as `ToolFormat.parse` strips content.
"""

from __future__ import annotations

import uuid

from tether.chat import FinishReason, JsonDict
from tether.chat.tool_format import ContentDelta, MalformedCall, StreamEvent, ToolCallStream
from tether.serving.jobs import Job


def call_id(index: int) -> str:
    """A fresh id per call: clients match results to calls by id across the whole conversation."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_entry(index: int, call_id: str, name: str, arguments: str) -> JsonDict:
    """A call as streamed `delta.tool_calls` write it (`message.tool_calls` leave the index out)."""
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class ReplyReader:
    """One sample's text, fed in deltas, as OpenAI `delta` objects."""

    def __init__(self, job: Job) -> None:
        self.parser: ToolCallStream | None = job.tool_format.stream(call_id) if job.reads_calls else None
        self.calls = 0
        self.spoken = False  # content went out: later whitespace may matter
        self.pending = ""  # whitespace not yet known to be more than a separator
        self.finished = False

    def feed(self, text: str) -> list[JsonDict]:
        assert not self.finished, "feed after finish"
        if self.parser is None:
            return [{"content": text}] if text else []
        return self._deltas(self.parser.feed(text))

    def finish(self) -> list[JsonDict]:
        """The end of the sample: what the parser held back."""
        self.finished = True
        return [] if self.parser is None else self._deltas(self.parser.finish())

    def finish_reason(self, reason: str | None) -> str | None:
        """`reason` as OpenAI states it: a reply that ended by itself after calls ended for them."""
        stopped = reason == FinishReason.STOP.value
        return FinishReason.TOOL_CALLS.value if stopped and self.calls else reason

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


def assistant_reply(job: Job, text: str, finish_reason: str | None) -> tuple[JsonDict, str | None]:
    """The message a whole reply is, and its finish reason ("tool_calls" when it made calls)."""
    reader = ReplyReader(job)
    deltas = reader.feed(text) + reader.finish()
    content = "".join(delta.get("content", "") for delta in deltas)
    message: JsonDict = {"role": "assistant", "content": content, "refusal": None}
    calls = [entry for delta in deltas for entry in delta.get("tool_calls", [])]
    if calls:
        message["content"] = content or None
        message["tool_calls"] = [{key: entry[key] for key in ("id", "type", "function")} for entry in calls]
    return message, reader.finish_reason(finish_reason)
