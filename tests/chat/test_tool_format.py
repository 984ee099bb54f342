"""The one tool-call format: whole replies and streamed deltas parse alike, malformed blocks are reported
in place (never dropped), and calls written back parse to themselves."""

from __future__ import annotations

import json

import pytest

from tether.chat import ToolCall, ToolSpec
from tether.chat.tool_format import (
    HERMES,
    MALFORMED_TOOL,
    CallDelta,
    ContentDelta,
    MalformedCall,
    malformed_result,
)

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'


def test_a_reply_splits_into_prose_and_calls_in_order() -> None:
    reply = HERMES.parse(f'Let me run it.\n{CALL}\n<tool_call>{{"name": "submit"}}</tool_call>')
    assert reply.content == "Let me run it."
    assert reply.calls == [
        ToolCall("call_0", "python", '{"code": "print(1)"}'),
        ToolCall("call_1", "submit", "{}"),
    ]
    assert reply.malformed == []


def test_a_reply_without_calls_is_all_content() -> None:
    reply = HERMES.parse("  The answer is 4.  ")
    assert (reply.content, reply.blocks) == ("The answer is 4.", ())
    assert "tool_calls" not in reply.message()


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("{not json", "not valid JSON"),
        ('["python"]', "expected a JSON object"),
        ('{"arguments": {}}', "'name' must be a non-empty string"),
        ('{"name": "python", "arguments": [1]}', "must be a JSON object"),
        ('{"name": "python", "arguments": "nope"}', "string that is not JSON"),
        ('{"name": "python", "parameters": {}}', "unexpected keys ['parameters']"),
    ],
)
def test_malformed_blocks_are_reported_in_their_place(body: str, reason: str) -> None:
    reply = HERMES.parse(f"{CALL}<tool_call>{body}</tool_call>")
    assert len(reply.calls) == 1
    (malformed,) = reply.malformed
    assert reason in malformed.reason
    assert malformed.raw == f"<tool_call>{body}</tool_call>"
    calls = reply.message()["tool_calls"]
    assert [call["function"]["name"] for call in calls] == ["python", MALFORMED_TOOL]
    result = malformed_result(ToolCall.from_openai(calls[1]))
    assert result.error and reason.split("'")[0] in result.content and "<tool_call>" in result.content


def test_an_unclosed_block_is_malformed_not_dropped() -> None:
    reply = HERMES.parse('Running.<tool_call>{"name": "python", "arguments": {"code": "1"}')
    assert reply.content == "Running."
    (malformed,) = reply.malformed
    assert "never closed" in malformed.reason


def test_arguments_written_as_a_json_string_are_read_as_the_object() -> None:
    reply = HERMES.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert reply.calls[0].parsed_arguments() == {"a": 1}


def test_a_call_written_back_parses_to_itself() -> None:
    call = ToolCall("call_0", "write_file", json.dumps({"path": "a.py", "content": "x = '</tool'\n"}))
    assert HERMES.parse(HERMES.call_text(call)).calls == [call]


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_streamed_deltas_give_what_the_whole_reply_gives(piece: int) -> None:
    text = f"Plan: < is fine, <tool not a tag.\n{CALL}tail <tool_call>{{bad</tool_call> end <tool_ca"
    stream = HERMES.stream(lambda index: f"id{index}")
    events = []
    for start in range(0, len(text), piece):
        events += stream.feed(text[start : start + piece])
    events += stream.finish()
    content = "".join(event.text for event in events if isinstance(event, ContentDelta))
    blocks = [event.block for event in events if isinstance(event, CallDelta)]
    whole = HERMES.parse(text, lambda index: f"id{index}")
    assert content.strip() == whole.content
    assert tuple(blocks) == whole.blocks
    assert "<tool_call>" not in content.replace("<tool_ca", "")  # no tag leaks into the prose
    assert content.endswith("end <tool_ca")  # a partial tag at the very end is prose after all
    assert [type(block) for block in blocks] == [ToolCall, MalformedCall]


def test_prose_streams_before_the_call_arrives() -> None:
    stream = HERMES.stream()
    assert stream.feed("Hello <tool") == [ContentDelta("Hello ")]
    assert stream.feed("_call>{") == []
    (event,) = stream.feed('"name": "f", "arguments": {}}</tool_call>')
    assert isinstance(event, CallDelta) and event.index == 0 and event.block == ToolCall("call_0", "f", "{}")


def test_the_system_prompt_lists_every_tool_schema() -> None:
    spec = ToolSpec("python", "Run code.", {"type": "object", "properties": {"code": {"type": "string"}}})
    prompt = HERMES.system_prompt([spec])
    assert json.dumps(spec.openai()) in prompt and "<tool_call>" in prompt
