"""A tool's definition and argument checks, and the toolbox that answers the model's mistakes (no sandbox)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tether.chat import JsonDict, ToolCall, ToolSpec, tool_calls_of
from tether.chat.tool_format import HERMES, MALFORMED_TOOL
from tether.tools import BUILTIN_TOOLS, SHELL, NoWorkspace, Tool, Toolbox, ToolError, Workspace

NO_SANDBOX = NoWorkspace("no sandbox in this test")


async def echo(_workspace: Workspace, arguments: JsonDict, _key: str) -> str:
    if arguments["text"] == "refuse":
        raise ToolError("echo refuses to echo 'refuse'")
    return f"{arguments['text']} x{arguments.get('times', 1)}"


ECHO = Tool(
    ToolSpec(
        "echo",
        "Echo text.",
        {
            "type": "object",
            "properties": {
                "text": {"type": "string"},
                "times": {"type": "integer", "minimum": 1},
                "mode": {"enum": ["loud", "quiet"]},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["text"],
            "additionalProperties": False,
        },
    ),
    echo,
)


def call(name: str, arguments: Any) -> ToolCall:
    return ToolCall("c1", name, arguments if isinstance(arguments, str) else json.dumps(arguments))


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({}, "arguments: 'text' is a required property"),
        ({"text": 5}, "text: 5 is not of type 'string'"),
        ({"text": "a", "times": 0}, "times: 0 is less than the minimum of 1"),
        ({"text": "a", "mode": "shout"}, "mode: 'shout' is not one of ['loud', 'quiet']"),
        ({"text": "a", "tags": ["x", 3]}, "tags/1: 3 is not of type 'string'"),
        ({"text": "a", "colour": "red"}, "('colour' was unexpected)"),
        ([1, 2], "expected a JSON object, got list"),
        ("not json", "not valid JSON"),
    ],
)
def test_bad_arguments_are_refused_naming_the_field_and_what_is_accepted(
    arguments: Any, problem: str
) -> None:
    with pytest.raises(ToolError) as raised:
        if isinstance(arguments, str):
            ECHO.parse_arguments(call("echo", arguments))
        else:
            ECHO.check_arguments(arguments)
    message = str(raised.value)
    assert message.startswith("bad arguments for echo: ") and problem in message
    if not isinstance(arguments, str | list):
        assert "accepted: text (string, required), times (integer), mode (any), tags (array)" in message


def test_every_problem_of_a_call_is_listed_at_once() -> None:
    with pytest.raises(ToolError) as raised:
        SHELL.check_arguments({"cmd": "ls"})
    assert "'command' is a required property" in str(raised.value)
    assert "('cmd' was unexpected)" in str(raised.value)


def test_valid_arguments_pass_unchanged() -> None:
    arguments = {"text": "hi", "times": 2, "tags": ["a"]}
    assert ECHO.check_arguments(arguments) == arguments
    assert ECHO.parse_arguments(call("echo", arguments)) == arguments


@pytest.mark.parametrize(
    ("parameters", "error"),
    [
        ({"type": "object", "properties": {"a": {"type": "strng"}}}, "not a JSON schema"),
        ({"type": "array"}, "must describe an object"),
    ],
)
def test_a_tool_with_a_bad_schema_is_refused_when_defined(parameters: JsonDict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        Tool(ToolSpec("bad", "Bad.", parameters), echo)


def test_tool_names_in_a_toolbox_are_unique() -> None:
    with pytest.raises(ValueError, match="'echo' is given twice"):
        Toolbox((ECHO, ECHO))


async def test_the_toolbox_answers_mistakes_with_error_results() -> None:
    box = Toolbox((ECHO,))
    unknown, ends = await box.call(NO_SANDBOX, call("rm_rf", {}))
    assert unknown.error and not ends
    assert unknown.content == "unknown tool 'rm_rf'; available: echo"
    assert unknown.message() == {
        "role": "tool",
        "tool_call_id": "c1",
        "name": "rm_rf",
        "content": "unknown tool 'rm_rf'; available: echo",
    }
    bad, _ = await box.call(NO_SANDBOX, call("echo", {"text": 1}))
    assert bad.error and "text: 1 is not of type 'string'" in bad.content
    refused, _ = await box.call(NO_SANDBOX, call("echo", {"text": "refuse"}))
    assert refused.error and refused.content == "echo refuses to echo 'refuse'"
    good, ends = await box.call(NO_SANDBOX, call("echo", {"text": "hi", "times": 3}))
    assert not good.error and good.content == "hi x3" and not ends


async def test_a_successful_submit_ends_and_its_text_is_the_answer() -> None:
    result, ends = await BUILTIN_TOOLS.call(NO_SANDBOX, call("submit", {"answer": "  42 \n"}))
    assert ends and not result.error and result.content == "42"
    result, ends = await BUILTIN_TOOLS.call(NO_SANDBOX, call("submit", {}))
    assert result.error and not ends


async def test_a_tool_that_needs_a_sandbox_reports_its_absence_to_the_model() -> None:
    result, _ = await BUILTIN_TOOLS.call(NO_SANDBOX, call("shell", {"command": "ls"}))
    assert result.error and result.content == "no sandbox in this test"


def test_only_keeps_the_named_tools_in_the_order_given() -> None:
    assert BUILTIN_TOOLS.only(("finish", "nope", "shell")).names == ("finish", "shell")
    assert BUILTIN_TOOLS.names == (
        "shell",
        "python",
        "write_file",
        "read_file",
        "submit",
        "finish",
        "handoff",
    )


async def test_a_call_the_parser_could_not_read_is_answered_with_its_error() -> None:
    reply = HERMES.parse('Running it.\n<tool_call>{"name": "echo", "arguments": {"text": "hi"</tool_call>')
    (malformed,) = tool_calls_of(reply.message())
    assert malformed.name == MALFORMED_TOOL
    result, ends = await Toolbox((ECHO,)).call(NO_SANDBOX, malformed)
    assert result.error and not ends
    assert result.content.startswith("error: your tool call could not be read (not valid JSON")
    assert result.message()["tool_call_id"] == malformed.id
