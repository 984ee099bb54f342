"""A chat reply's text, streamed in any split, as OpenAI deltas: prose as content, each call as one
`tool_calls` entry, no tag of a well-formed call in content, and the same reply as the whole response."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.chat import ToolCall, ToolSpec
from tether.chat.tool_format import HERMES
from tether.engine.sampling import SamplingParams
from tether.serving.chat import ChatPlan, ToolMode
from tether.serving.jobs import Job
from tether.serving.replies import ReplyReader, assistant_reply

ADD = ToolSpec("add", "a + b", {"type": "object"})
FIRST = HERMES.call_text(ToolCall("x", "add", '{"a": 1, "b": 2}'))
SECOND = HERMES.call_text(ToolCall("y", "add", '{"a": 3, "b": 4}'))
REPLIES = {
    "prose": "Just an answer, no tools.",
    "one-call": FIRST,
    "prose-then-call": f"Let me add that.\n{FIRST}",
    "parallel-calls": f"{FIRST}\n{SECOND}",
    "malformed": "<tool_call>\n{not json}\n</tool_call>",
    "unclosed": 'Trying: <tool_call>\n{"name": "add"',
    "tag-like-prose": "a < b and <tool is not a tag",
}


def job(mode: ToolMode = ToolMode.AUTO) -> Job:
    plan = ChatPlan([], (ADD,), mode, True, None)
    return Job("chat", [1], SamplingParams(), 0, True, False, False, "m", plan=plan)


def streamed(job: Job, pieces: list[str]) -> tuple[str, list[dict[str, Any]], str | None]:
    """The content and calls a client assembles from the deltas of `pieces`, and the finish reason."""
    stream = ReplyReader(job)
    deltas = [delta for piece in pieces for delta in stream.feed(piece)] + stream.finish()
    content = "".join(delta.get("content", "") for delta in deltas)
    calls = [entry for delta in deltas for entry in delta.get("tool_calls", [])]
    return content, calls, stream.finish_reason("stop")


def splits(text: str) -> st.SearchStrategy[list[str]]:
    cuts = st.lists(st.integers(0, len(text)), max_size=8).map(sorted)
    return cuts.map(lambda at: [text[a:b] for a, b in zip([0, *at], [*at, len(text)], strict=True)])


@pytest.mark.parametrize("name", REPLIES)
def test_any_split_streams_what_the_whole_response_says(name: str) -> None:
    reply = REPLIES[name]
    message, reason = assistant_reply(job(), reply, "stop")

    @settings(max_examples=40, deadline=None)
    @given(pieces=splits(reply))
    def property(pieces: list[str]) -> None:
        content, calls, streamed_reason = streamed(job(), pieces)
        assert streamed_reason == reason
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls", [])
        ]
        assert [c["index"] for c in calls] == list(range(len(calls)))
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
        if calls:
            assert "<tool_call>" not in content and content == (message["content"] or "")
        else:
            assert content == message["content"]

    property()


def test_calls_are_read_only_when_the_request_declared_tools_and_allowed_them() -> None:
    for mode in (ToolMode.NONE,):
        content, calls, reason = streamed(job(mode), [FIRST])
        assert content == FIRST and not calls and reason == "stop"
        message, whole_reason = assistant_reply(job(mode), FIRST, "stop")
        assert message["content"] == FIRST and "tool_calls" not in message and whole_reason == "stop"


def test_whole_reply_with_calls_has_null_content_and_fresh_ids() -> None:
    message, reason = assistant_reply(job(), f"{FIRST}\n{SECOND}", "stop")
    again, _ = assistant_reply(job(), FIRST, "stop")
    assert reason == "tool_calls" and message["content"] is None
    ids = [call["id"] for call in message["tool_calls"]] + [again["tool_calls"][0]["id"]]
    assert len(set(ids)) == 3


def test_malformed_block_goes_back_as_content_in_its_place() -> None:
    bad = '<tool_call>\n{"name": 5}\n</tool_call>'
    message, reason = assistant_reply(job(), f"{FIRST}\n{bad}", "stop")
    assert message["content"] == bad and reason == "tool_calls"
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["add"]
    alone, alone_reason = assistant_reply(job(), bad, "stop")
    assert alone["content"] == bad and "tool_calls" not in alone and alone_reason == "stop"


def test_reply_cut_by_the_token_budget_keeps_its_finish_reason() -> None:
    message, reason = assistant_reply(job(), f'{FIRST}\n<tool_call>\n{{"na', "length")
    assert reason == "length" and len(message["tool_calls"]) == 1
    assert message["content"] == '<tool_call>\n{"na'
