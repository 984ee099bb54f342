"""The chat types: messages' text, tool specs and calls in and out of the OpenAI form, results, usage."""

from __future__ import annotations

import pytest

from tether.chat import (
    ChatError,
    ToolCall,
    ToolResult,
    ToolSpec,
    Usage,
    assistant_message,
    message_text,
    tool_calls_of,
)
from tether.chat.completion import BadUsage


def test_message_text_reads_string_list_and_missing_content() -> None:
    assert message_text({"role": "assistant", "content": "a"}) == "a"
    parts = [{"type": "text", "text": "b"}, {"type": "image"}]
    assert message_text({"role": "assistant", "content": parts}) == "b"
    assert message_text({"role": "assistant"}) == ""
    with pytest.raises(ChatError, match="string or a list of parts"):
        message_text({"role": "assistant", "content": 5})


def test_tool_calls_convert_from_openai_with_object_arguments() -> None:
    raw = {"id": "x", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    parsed = ToolCall.from_openai(raw)
    assert parsed.parsed_arguments() == {"a": 1}
    assert ToolCall.from_openai({"function": {"name": "f"}}, index=3).id == "call_3"
    with pytest.raises(ChatError, match="no function name"):
        ToolCall.from_openai({"function": {}})


@pytest.mark.parametrize(
    ("arguments", "problem"), [("{", "not valid JSON"), ("[1]", "must be a JSON object")]
)
def test_tool_call_arguments_that_are_not_an_object_are_refused(arguments: str, problem: str) -> None:
    with pytest.raises(ChatError, match=problem):
        ToolCall("c", "f", arguments).parsed_arguments()


def test_an_assistant_message_round_trips_its_calls() -> None:
    calls = [ToolCall("c0", "python", '{"code": "1"}'), ToolCall("c1", "submit", '{"answer": "2"}')]
    message = assistant_message("thinking", calls)
    assert tool_calls_of(message) == calls
    assert "tool_calls" not in assistant_message("plain")
    result = ToolResult("c0", "python", "out")
    assert result.message() == {"role": "tool", "tool_call_id": "c0", "name": "python", "content": "out"}


def test_tool_specs_round_trip_and_bad_ones_are_named() -> None:
    spec = ToolSpec("f", "does f", {"type": "object", "properties": {}})
    assert ToolSpec.from_openai(spec.openai()) == spec
    with pytest.raises(ChatError, match="no function name"):
        ToolSpec.from_openai({"type": "function", "function": {}})
    with pytest.raises(ChatError, match="expected"):
        ToolSpec.from_openai({"type": "code_interpreter"})


def test_usage_reads_openai_and_refuses_inconsistent_counts() -> None:
    usage = Usage.from_openai(
        {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}}
    )
    assert usage == Usage(prompt_tokens=5, cached_tokens=3, completion_tokens=2)
    assert Usage.from_openai(usage.openai()) == usage
    assert usage.total_tokens == 7
    with pytest.raises(BadUsage, match="exceeds"):
        Usage(prompt_tokens=1, cached_tokens=2)
    with pytest.raises(BadUsage, match="integers"):
        Usage.from_openai({"prompt_tokens": "5", "completion_tokens": 1})
