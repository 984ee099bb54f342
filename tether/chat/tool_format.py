"""How a model writes tool calls in text, read back in one place: whole replies and streamed deltas.

A chat template that knows tools (Qwen, Hermes and most open models) has the model write each call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` and shows results in `<tool_response>` blocks;
templates that know no tools (SmolLM2) are taught the same convention in the system prompt
(`ToolFormat.system_prompt`). Parsing is strict: a block that is not a JSON object with a string `name`
and an object of `arguments`, or that is never closed, becomes a `MalformedCall` in its place, so the
caller can answer it with an error the model sees (`malformed_result`) instead of dropping it. This
module only reads and writes text; which format a model uses is decided from its template
(`template.py`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tether.chat.messages import Message, ToolCall, ToolResult, ToolSpec

# The name a malformed block's call carries in an assistant message, so that an episode or an agent
# answers it with the parse error (tool names in OpenAI's API may not contain a dot).
MALFORMED_TOOL = "tether.malformed_tool_call"
CallIds = Callable[[int], str]


def default_ids(index: int) -> str:
    return f"call_{index}"


@dataclass(frozen=True, slots=True)
class MalformedCall:
    """A block that was meant as a tool call but cannot be read as one; `raw` is the text as written."""

    raw: str
    reason: str

    def as_call(self, call_id: str) -> ToolCall:
        return ToolCall(call_id, MALFORMED_TOOL, json.dumps({"raw": self.raw, "error": self.reason}))


Block = ToolCall | MalformedCall


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """A reply split into its prose and its call blocks, in the order they were written."""

    content: str
    blocks: tuple[Block, ...] = ()

    @property
    def calls(self) -> list[ToolCall]:
        return [block for block in self.blocks if isinstance(block, ToolCall)]

    @property
    def malformed(self) -> list[MalformedCall]:
        return [block for block in self.blocks if isinstance(block, MalformedCall)]

    def message(self, ids: CallIds = default_ids) -> Message:
        """The assistant message an episode or agent steps with: malformed blocks stay in their place as
        calls to `MALFORMED_TOOL`, which `malformed_result` answers."""
        calls = [
            block if isinstance(block, ToolCall) else block.as_call(ids(index))
            for index, block in enumerate(self.blocks)
        ]
        message: Message = {"role": "assistant", "content": self.content}
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        return message


def malformed_result(call: ToolCall) -> ToolResult:
    """The error observation for a call to `MALFORMED_TOOL`: what was wrong and how to write a call."""
    try:
        reason = str(json.loads(call.arguments).get("error", "unreadable"))
    except (json.JSONDecodeError, AttributeError):
        reason = "unreadable"
    text = (
        f"error: your tool call could not be read ({reason}); write each call as "
        '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>'
    )
    return ToolResult(call.id, call.name, text, error=True)


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A complete block, streamed once its closing tag arrived; `index` counts blocks from 0."""

    index: int
    block: Block


StreamEvent = ContentDelta | CallDelta


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One convention of writing calls: the tags around a call and around a result."""

    name: str
    call_open: str
    call_close: str
    result_open: str
    result_close: str

    def system_prompt(self, tools: Sequence[ToolSpec]) -> str:
        """What a template that knows no tools is told, after its own system prompt."""
        listed = "\n".join(json.dumps(tool.openai()) for tool in tools)
        return (
            "# Tools\n\nYou may call functions to help with the request. Their signatures, as JSON "
            f"schemas, are inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments inside "
            f"{self.call_open}{self.call_close} tags, one block per call:\n"
            f'{self.call_open}\n{{"name": "FUNCTION", "arguments": {{...}}}}\n{self.call_close}\n'
            "Then stop: each result comes back to you in the next message."
        )

    def call_text(self, call: ToolCall) -> str:
        """A call written the way the model writes it; arguments that are not JSON stay a string."""
        try:
            arguments: object = json.loads(call.arguments)
        except json.JSONDecodeError:
            arguments = call.arguments
        body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.call_open}\n{body}\n{self.call_close}"

    def result_text(self, content: str) -> str:
        return f"{self.result_open}\n{content}\n{self.result_close}"

    def read_block(self, body: str) -> Block:
        """The call a block's body (between the tags) states, or why it states none."""
        raw = f"{self.call_open}{body}{self.call_close}"
        try:
            value = json.loads(body)
        except json.JSONDecodeError as error:
            return MalformedCall(raw, f"not valid JSON: {error}")
        if not isinstance(value, dict):
            return MalformedCall(raw, f"expected a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - {"name", "arguments"})
        if unknown:
            return MalformedCall(raw, f"unexpected keys {unknown}; a call has 'name' and 'arguments'")
        name = value.get("name")
        if not isinstance(name, str) or not name:
            return MalformedCall(raw, "'name' must be a non-empty string")
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return MalformedCall(raw, f"the arguments of {name} are a string that is not JSON")
        if not isinstance(arguments, dict):
            return MalformedCall(raw, f"the arguments of {name} must be a JSON object")
        return ToolCall("", name, json.dumps(arguments, ensure_ascii=False))

    def parse(self, text: str, ids: CallIds = default_ids) -> ParsedReply:
        """A whole reply: its prose (stripped) and its blocks, each call given `ids(index)`."""
        stream = self.stream(ids)
        events = stream.feed(text) + stream.finish()
        content = "".join(event.text for event in events if isinstance(event, ContentDelta))
        blocks = tuple(event.block for event in events if isinstance(event, CallDelta))
        return ParsedReply(content.strip(), blocks)

    def stream(self, ids: CallIds = default_ids) -> ToolCallStream:
        return ToolCallStream(self, ids)


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (kept until more arrives)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass(slots=True)
class ToolCallStream:
    """Incremental parsing of a reply as it is generated: prose streams out at once (except a possible
    start of an opening tag, held back until it is told apart), each block once it is closed."""

    format: ToolFormat
    ids: CallIds = default_ids
    _buffer: str = ""
    _inside: bool = False
    _blocks: int = 0
    _closed: bool = False

    def feed(self, text: str) -> list[StreamEvent]:
        assert not self._closed, "feed after finish"
        self._buffer += text
        events: list[StreamEvent] = []
        while True:
            if self._inside:
                end = self._buffer.find(self.format.call_close)
                if end < 0:
                    return events
                events.append(self._block(self._buffer[:end]))
                self._buffer = self._buffer[end + len(self.format.call_close) :]
                self._inside = False
                continue
            start = self._buffer.find(self.format.call_open)
            if start < 0:
                keep = _held_back(self._buffer, self.format.call_open)
                ready, self._buffer = (
                    self._buffer[: len(self._buffer) - keep],
                    self._buffer[len(self._buffer) - keep :],
                )
                if ready:
                    events.append(ContentDelta(ready))
                return events
            if start:
                events.append(ContentDelta(self._buffer[:start]))
            self._buffer = self._buffer[start + len(self.format.call_open) :]
            self._inside = True

    def finish(self) -> list[StreamEvent]:
        """The end of the reply: held-back prose, or an unclosed block reported as malformed."""
        self._closed = True
        rest, self._buffer = self._buffer, ""
        if self._inside:
            raw = f"{self.format.call_open}{rest}"
            block = MalformedCall(raw, f"{self.format.call_open} is never closed by {self.format.call_close}")
            return [self._numbered(block)]
        return [ContentDelta(rest)] if rest else []

    def _block(self, body: str) -> CallDelta:
        return self._numbered(self.format.read_block(body))

    def _numbered(self, block: Block) -> CallDelta:
        index = self._blocks
        self._blocks += 1
        if isinstance(block, ToolCall):
            block = ToolCall(self.ids(index), block.name, block.arguments)
        return CallDelta(index, block)


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
FORMATS: dict[str, ToolFormat] = {HERMES.name: HERMES}
