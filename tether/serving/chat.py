"""A chat request's messages, tools and tool choice, checked and turned into what the engine runs: the
conversation in `tether.chat` form, the tools as `ToolSpec`s, and the grammar decoding must follow.

Pure: every problem is a 400 naming the field (`messages.3.tool_call_id`, `tools.0.function.parameters`,
`tool_choice`); prompts are rendered and replies parsed by `tether.chat`'s template and tool format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum

from tether.chat import JsonDict, Message, Messages, ToolSpec
from tether.chat.tool_format import ToolFormat
from tether.engine.structured import StructuredOutput
from tether.serving.constraints import (
    NO_ARGUMENTS,
    check_schema,
    response_constraint,
    tool_constraint,
)
from tether.serving.openai_api import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
)


class ToolMode(StrEnum):
    """What the model may do with the tools: OpenAI's `tool_choice` ("function" when one is named)."""

    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    FUNCTION = "function"


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """A checked chat request: the conversation, the tools the model sees, whether its replies are read
    for tool calls, and the grammar its tokens must follow (None: unconstrained)."""

    messages: Messages
    tools: tuple[ToolSpec, ...]
    mode: ToolMode
    parallel_tool_calls: bool
    structured: StructuredOutput | None

    @property
    def reads_calls(self) -> bool:
        return bool(self.tools) and self.mode is not ToolMode.NONE


def _message(index: int, message: ChatMessage, call_ids: set[str]) -> Message:
    """One history message in `tether.chat` form; `call_ids` collects the calls it makes."""
    where = f"messages.{index}"
    out: Message = {"role": "system" if message.role == "developer" else message.role}
    out["content"] = message.text
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        if message.role != "assistant":
            raise APIError(
                400, f"{where}.tool_calls: only assistant messages make tool calls", f"{where}.tool_calls"
            )
        calls = []
        for number, call in enumerate(message.tool_calls):
            param = f"{where}.tool_calls.{number}.function.arguments"
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError as error:
                raise APIError(400, f"{param}: not valid JSON: {error}", param) from None
            if not isinstance(arguments, dict):
                raise APIError(400, f"{param}: expected a JSON object, got {arguments!r}", param)
            call_ids.add(call.id)
            calls.append({"id": call.id, "type": "function", "function": call.function.model_dump()})
        out["tool_calls"] = calls
    if message.role == "tool":
        param = f"{where}.tool_call_id"
        if message.tool_call_id is None:
            raise APIError(400, f"{param}: a tool message must name the call it answers", param)
        if message.tool_call_id not in call_ids:
            raise APIError(
                400,
                f"{param}: {message.tool_call_id!r} answers no tool call of an earlier assistant message",
                param,
            )
        out["tool_call_id"] = message.tool_call_id
    elif message.tool_call_id is not None:
        raise APIError(
            400, f"{where}.tool_call_id: only tool messages answer a call", f"{where}.tool_call_id"
        )
    return out


def chat_messages(body: ChatCompletionRequest) -> Messages:
    """The history, checked: tool messages answer earlier calls, and calls carry JSON object arguments."""
    call_ids: set[str] = set()
    return [_message(index, message, call_ids) for index, message in enumerate(body.messages)]


def chat_tools(body: ChatCompletionRequest) -> list[ToolSpec]:
    """The declared tools; names unique, parameters a JSON schema of an object."""
    tools: list[ToolSpec] = []
    for index, tool in enumerate(body.tools or []):
        function = tool.function
        if any(known.name == function.name for known in tools):
            param = f"tools.{index}.function.name"
            raise APIError(400, f"{param}: {function.name!r} is declared twice", param)
        parameters: JsonDict = NO_ARGUMENTS if function.parameters is None else function.parameters
        param = f"tools.{index}.function.parameters"
        check_schema(parameters, param)
        if parameters.get("type", "object") != "object":
            kind = parameters.get("type")
            raise APIError(
                400, f"{param}: arguments are a JSON object, but the schema's type is {kind!r}", param
            )
        tools.append(ToolSpec(function.name, function.description or "", parameters))
    return tools


def _mode(body: ChatCompletionRequest, tools: list[ToolSpec]) -> tuple[ToolMode, str | None]:
    choice = body.tool_choice
    if choice is None:
        return (ToolMode.AUTO if tools else ToolMode.NONE), None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if not any(tool.name == name for tool in tools):
            declared = ", ".join(repr(tool.name) for tool in tools) or "none"
            param = "tool_choice.function.name"
            raise APIError(400, f"{param}: {name!r} is not a declared tool (declared: {declared})", param)
        return ToolMode.FUNCTION, name
    mode = ToolMode(choice)
    if mode is ToolMode.REQUIRED and not tools:
        raise APIError(400, "tool_choice: 'required' needs tools, and none are declared", "tool_choice")
    return mode, None


def plan_chat(body: ChatCompletionRequest, fmt: ToolFormat) -> ChatPlan:
    """The checked request; `fmt` is how the served model writes calls."""
    messages = chat_messages(body)
    tools = chat_tools(body)
    mode, named = _mode(body, tools)
    structured = response_constraint(body.response_format)
    if tools and mode in (ToolMode.REQUIRED, ToolMode.FUNCTION):
        structured = tool_constraint(
            tools, fmt, only=named, parallel=body.parallel_tool_calls and named is None
        )
    elif tools and mode is ToolMode.AUTO and structured is not None:
        # the reply is either calls or the asked-for JSON; both are enforced
        answer: JsonDict = {"type": "object"}
        if isinstance(body.response_format, JsonSchemaFormat):
            answer = body.response_format.json_schema.json_schema
        assert isinstance(body.response_format, JsonSchemaFormat | JsonObjectFormat)
        structured = tool_constraint(tools, fmt, parallel=body.parallel_tool_calls, alternative=answer)
    elif tools and mode is ToolMode.AUTO:
        # prose is free, but a call the model starts is a valid one (and only one unless parallel)
        structured = tool_constraint(tools, fmt, parallel=body.parallel_tool_calls, prose=True)
    shown = tuple(tools) if mode is not ToolMode.NONE else ()
    return ChatPlan(messages, shown, mode, body.parallel_tool_calls, structured)
