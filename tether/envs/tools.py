"""The standard tools of multi-turn environments (`python`, `shell`, `submit`) and the text convention
for tool calls when a model is driven without an OpenAI-compatible server.

`python` and `shell` run in the episode's sandbox session, so files persist between calls and nothing
runs in this process. Over an OpenAI-compatible endpoint, tool calls arrive as `tool_calls`; an
in-process engine produces text, and `parse_text_tool_calls` reads `<tool_call>{json}</tool_call>`
blocks (the Hermes/Qwen convention most chat templates know) back into the same OpenAI form.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tether.chat import Message, ToolCall, ToolSpec
from tether.envs.episode import Tool
from tether.envs.errors import EnvError
from tether.envs.scoring import EpisodeState


def _string_arg(arguments: dict[str, Any], key: str) -> str:
    value = arguments.get(key)
    if not isinstance(value, str):
        raise EnvError(f"argument {key!r} must be a string, got {type(value).__name__}")
    return value


def describe_run(result: Any) -> str:
    """A sandbox `RunResult` as the text a model sees: status, exit code, stdout and stderr."""
    parts = [f"status: {result.status.value}"]
    if result.exit_code is not None:
        parts.append(f"exit code: {result.exit_code}")
    if result.stdout:
        parts.append("stdout:\n" + result.stdout)
    if result.stderr:
        parts.append("stderr:\n" + result.stderr)
    if result.error:
        parts.append("error: " + result.error)
    return "\n".join(parts)


async def _python(arguments: dict[str, Any], state: EpisodeState) -> str:
    return describe_run(await state.run(_string_arg(arguments, "code"), "python"))


async def _shell(arguments: dict[str, Any], state: EpisodeState) -> str:
    return describe_run(await state.run(_string_arg(arguments, "command"), "bash"))


async def _submit(arguments: dict[str, Any], state: EpisodeState) -> str:
    state.submitted = _string_arg(arguments, "answer").strip()
    return "submitted"


def python_tool() -> Tool:
    spec = ToolSpec(
        "python",
        "Run a Python 3 program in your sandbox; files in the working directory persist between calls.",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The program's source."}},
            "required": ["code"],
        },
    )
    return Tool(spec, _python, needs_session=True)


def shell_tool() -> Tool:
    spec = ToolSpec(
        "shell",
        "Run a bash command in your sandbox's working directory (no network).",
        {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The bash command line."}},
            "required": ["command"],
        },
    )
    return Tool(spec, _shell, needs_session=True)


def submit_tool() -> Tool:
    spec = ToolSpec(
        "submit",
        "Submit your final answer; this ends the episode.",
        {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The final answer."}},
            "required": ["answer"],
        },
    )
    return Tool(spec, _submit, ends_episode=True)


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
