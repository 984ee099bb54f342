"""The scripted client answers step n with line n, the same however often it is asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from tether.chat import ChatRequest, FinishReason, ToolCall
from tether.errors import ConfigError
from tether.testing.scripted import ScriptedClient


async def test_each_step_gets_its_line_and_a_step_past_the_end_is_done(tmp_path: Path) -> None:
    script = tmp_path / "s.jsonl"
    call = '{"name": "python", "arguments": {"code": "1"}}'
    script.write_text(f'{{"content": "a", "tool_calls": [{call}]}}\n\n{{"content": "b"}}\n')
    client = ScriptedClient.from_file(script)
    first = await client.complete(ChatRequest([], step_no=0))
    again = await client.complete(ChatRequest([], step_no=0))
    assert first == again
    assert first.tool_calls == [ToolCall("call_0_0", "python", '{"code": "1"}')]
    assert first.finish_reason is FinishReason.TOOL_CALLS
    assert (await client.complete(ChatRequest([], step_no=1))).content == "b"
    assert (await client.complete(ChatRequest([], step_no=5))).content == "done"


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("[1]", "expected an object"),
        ('{"text": "x"}', "expected an object"),
        ('{"content": 3}', "'content' must be a string"),
        ('{"tool_calls": [{"arguments": {}}]}', "tool_calls must be"),
        ("{bad", "not a JSON object"),
    ],
)
def test_bad_lines_are_refused_with_their_line_number(tmp_path: Path, line: str, problem: str) -> None:
    script = tmp_path / "s.jsonl"
    script.write_text(line + "\n")
    with pytest.raises(ConfigError, match=f"s.jsonl:1: .*{problem}"):
        ScriptedClient.from_file(script)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        ScriptedClient.from_file(tmp_path / "none.jsonl")
