"""What every subsystem exchanges with a model: chat messages in the OpenAI form, tool specs, tool calls
and tool results.

Messages stay plain JSON objects (`{"role", "content", "tool_calls"?, "tool_call_id"?, "name"?}`) because
they are journaled, logged, sent over HTTP and rendered by chat templates as they are; the typed values
here are what code builds them from and reads them as. There is one `ToolCall` in the package.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tether.errors import TetherError

# One chat message in the OpenAI format: {"role": ..., "content": ..., "tool_calls"?: [...]}.
Message = dict[str, Any]
Messages = list[Message]
JsonDict = dict[str, Any]


class ChatError(TetherError):
    """A message, tool call or completion that does not have the shape the chat format defines."""


def message_text(message: Mapping[str, Any]) -> str:
    """The text of a message whose content is a string, a list of parts, or absent."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    raise ChatError(f"message content must be a string or a list of parts, got {type(content).__name__}")


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A function the model may call, described by a JSON schema of its arguments."""

    name: str
    description: str
    parameters: JsonDict

    def openai(self) -> JsonDict:
        """The entry of an OpenAI chat request's `tools` list."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    @classmethod
    def from_openai(cls, raw: Mapping[str, Any]) -> ToolSpec:
        function = raw.get("function")
        if raw.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise ChatError(f"tool {raw!r}: expected {{'type': 'function', 'function': {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ChatError(f"tool {raw!r} has no function name")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, Mapping):
            raise ChatError(f"tool {name!r}: parameters must be a JSON schema object")
        return cls(name, str(function.get("description") or ""), dict(parameters))


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call from an assistant message's `tool_calls`; `arguments` is the raw JSON string."""

    id: str
    name: str
    arguments: str

    @classmethod
    def from_openai(cls, raw: Mapping[str, Any], index: int = 0) -> ToolCall:
        function = raw.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatError(f"tool call {raw!r} has no function name")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):  # some servers send an object; normalise to the OpenAI string
            arguments = json.dumps(arguments)
        return cls(str(raw.get("id") or f"call_{index}"), function["name"], arguments)

    def openai(self) -> JsonDict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def parsed_arguments(self) -> JsonDict:
        try:
            value = json.loads(self.arguments or "{}")
        except json.JSONDecodeError as error:
            raise ChatError(f"arguments of {self.name} are not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ChatError(f"arguments of {self.name} must be a JSON object, got {type(value).__name__}")
        return value


def tool_calls_of(message: Mapping[str, Any]) -> list[ToolCall]:
    """The tool calls of an assistant message, in order (none when it has no `tool_calls`)."""
    return [ToolCall.from_openai(raw, index) for index, raw in enumerate(message.get("tool_calls") or [])]


def assistant_message(content: str, calls: list[ToolCall] | None = None) -> Message:
    """An assistant message in OpenAI form; `tool_calls` only when there are calls."""
    message: Message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.openai() for call in calls]
    return message


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What a tool call produced, as the model will read it; `error` marks a failed or refused call."""

    call_id: str
    name: str
    content: str
    error: bool = False

    def message(self) -> Message:
        """The `role: "tool"` message that answers the call."""
        return {"role": "tool", "tool_call_id": self.call_id, "name": self.name, "content": self.content}
