"""A model's chat template, with tools: the one place messages and tool specs become the text (and
token ids) a model reads, and where the model's tool-call format is decided.

A template that renders `tools` itself (Qwen, Hermes-style) is given them through
`apply_chat_template(tools=...)`, and its call markers name the format (`tool_format.FORMATS`). A template
that knows no tools (SmolLM2) gets the Hermes convention in text: the tools described after the system
prompt, earlier calls written back as the model writes them, results as `<tool_response>` user turns.
A template that renders tools in a format tether cannot parse is refused when tools are asked for,
rather than trained or served with calls nobody reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tether.chat.messages import ChatError, Message, Messages, ToolCall, ToolSpec, message_text
from tether.chat.tool_format import FORMATS, HERMES, ToolFormat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _template_source(tokenizer: PreTrainedTokenizerBase) -> str:
    template: Any = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one renders chats
        template = template.get("default") or next(iter(template.values()), "")
    return template if isinstance(template, str) else ""


class ChatTemplate:
    """Renders conversations with tools for one tokenizer; `format` is how its model writes calls."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        source = _template_source(tokenizer)
        if not source:
            raise ChatError("the tokenizer has no chat template; tether renders chats only through one")
        self.native_tools = "tools" in source
        known = [fmt for fmt in FORMATS.values() if fmt.call_open in source]
        self.format: ToolFormat | None = known[0] if known else (None if self.native_tools else HERMES)

    def tool_format(self) -> ToolFormat:
        """The format calls are parsed in; refused for a template whose own tool format is unknown."""
        if self.format is None:
            raise ChatError(
                "this model's chat template renders tools in a format tether does not parse "
                f"(known: {', '.join(FORMATS)}); use a model whose template writes {HERMES.call_open} calls"
            )
        return self.format

    def render(
        self, messages: Messages, tools: Sequence[ToolSpec] = (), generation_prompt: bool = True
    ) -> str:
        conversation, specs = self._arguments(messages, tools)
        text: Any = self.tokenizer.apply_chat_template(
            conversation, tools=specs, add_generation_prompt=generation_prompt, tokenize=False
        )
        return str(text)

    def encode(
        self, messages: Messages, tools: Sequence[ToolSpec] = (), generation_prompt: bool = True
    ) -> list[int]:
        conversation, specs = self._arguments(messages, tools)
        ids: Any = self.tokenizer.apply_chat_template(
            conversation,
            tools=specs,
            add_generation_prompt=generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        return [int(i) for i in ids]

    def _arguments(
        self, messages: Messages, tools: Sequence[ToolSpec]
    ) -> tuple[Messages, list[dict[Any, Any] | Callable[..., Any]] | None]:
        """The conversation as the template reads it, and the tool specs when it renders them itself."""
        uses_tools = bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if not uses_tools:
            return [_plain(message) for message in messages], None
        fmt = self.tool_format()
        if self.native_tools:
            specs: list[dict[Any, Any] | Callable[..., Any]] | None = [
                tool.openai() for tool in tools
            ] or None
            return [_native(message) for message in messages], specs
        return _text_convention(fmt, messages, tools), None


def _plain(message: Message) -> Message:
    role = message.get("role")
    return {"role": "system" if role == "developer" else str(role), "content": message_text(message)}


def _native(message: Message) -> Message:
    """A message as tool-aware templates read it: content a string, call arguments an object."""
    out = _plain(message)
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "type": "function",
                "id": call.id,
                "function": {"name": call.name, "arguments": _arguments(call)},
            }
            for call in (ToolCall.from_openai(raw, i) for i, raw in enumerate(message["tool_calls"]))
        ]
    for key in ("tool_call_id", "name"):
        if key in message:
            out[key] = message[key]
    return out


def _arguments(call: ToolCall) -> object:
    try:
        return json.loads(call.arguments)
    except json.JSONDecodeError:
        return call.arguments


def _text_convention(fmt: ToolFormat, messages: Messages, tools: Sequence[ToolSpec]) -> Messages:
    """Messages for a template that knows no tools: tools after the system prompt, calls written as the
    model writes them, consecutive results in one user turn of `<tool_response>` blocks."""
    out: Messages = []
    previous_was_result = False
    for message in messages:
        role, text = message.get("role"), message_text(message)
        if role in ("system", "developer") and tools and not out:
            out.append({"role": "system", "content": f"{text}\n\n{fmt.system_prompt(tools)}"})
        elif role == "assistant" and message.get("tool_calls"):
            calls = [ToolCall.from_openai(raw, i) for i, raw in enumerate(message["tool_calls"])]
            written = "\n".join(fmt.call_text(call) for call in calls)
            out.append({"role": "assistant", "content": f"{text}\n{written}" if text else written})
        elif role == "tool" and previous_was_result:
            out[-1]["content"] += "\n" + fmt.result_text(text)
        elif role == "tool":
            out.append({"role": "user", "content": fmt.result_text(text)})
        else:
            out.append(_plain(message))
        previous_was_result = role == "tool"
    if tools and not (out and out[0]["role"] == "system"):
        out.insert(0, {"role": "system", "content": fmt.system_prompt(tools)})
    return out
