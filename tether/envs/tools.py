"""The text convention for tool calls when a model is driven without an OpenAI-compatible server (the
tools themselves are `tether.tools`).

Over an OpenAI-compatible endpoint, tool calls arrive as `tool_calls`; an in-process engine produces
text, and `parse_text_tool_calls` reads `<tool_call>{json}</tool_call>` blocks (the Hermes/Qwen
convention most chat templates know) back into the same OpenAI form.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tether.chat import Message, ToolCall

TEXT_TOOL_INSTRUCTIONS = (
    "You can call tools. To call one, write a block "
    '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call> and stop; the result comes back in '
    "the next message. Available tools (JSON schema):\n"
)


def text_tool_prompt(tools: list[dict[str, Any]]) -> str:
    """The system-prompt addition that teaches the text convention, listing the tools' specs."""
    return TEXT_TOOL_INSTRUCTIONS + "\n".join(json.dumps(tool["function"]) for tool in tools)


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_text_tool_calls(text: str) -> Message:
    """An assistant message in OpenAI form from text that may hold `<tool_call>` blocks.

    A block that is not a JSON object with a string `name` becomes a call to the tool named
    `invalid` so that the episode answers it with an error instead of silently dropping it.
    """
    calls: list[dict[str, Any]] = []
    for index, raw in enumerate(_TOOL_CALL.findall(text)):
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("name"), str):
            arguments = body.get("arguments", {})
            call = ToolCall(f"call_{index}", body["name"], json.dumps(arguments))
        else:
            call = ToolCall(f"call_{index}", "invalid", json.dumps({"text": raw}))
        calls.append(call.openai())
    content = _TOOL_CALL.sub("", text).strip() if calls else text
    message: Message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message
