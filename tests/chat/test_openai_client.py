"""The OpenAI-compatible client: what it sends for a request, what it reads back, and how each failure
of the endpoint is named."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tether.chat import ChatRequest, FinishReason, ToolCall, ToolSpec, Usage
from tether.chat.completion import ModelError
from tether.chat.openai_client import OpenAIClient
from tether.chat.tool_format import MALFORMED_TOOL
from tether.errors import ConfigError

PYTHON = ToolSpec("python", "Run code.", {"type": "object", "properties": {"code": {"type": "string"}}})
REPLY = {
    "choices": [
        {
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "python", "arguments": "{}"}}
                ],
            },
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {"prompt_tokens": 9, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}},
}


def client_answering(status: int, body: Any, seen: list[dict[str, Any]]) -> OpenAIClient:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        text = body if isinstance(body, str) else json.dumps(body)
        return httpx.Response(status, text=text, headers={"content-type": "application/json"})

    return OpenAIClient("http://model.test/v1", "m", transport=httpx.MockTransport(handler))


async def test_a_request_with_tools_and_constraints_reads_back_calls_and_usage() -> None:
    seen: list[dict[str, Any]] = []
    client = client_answering(200, REPLY, seen)
    request = ChatRequest(
        [{"role": "user", "content": "hi"}],
        tools=(PYTHON,),
        tool_choice="python",
        seed=3,
        stop=("END",),
        response_format={"type": "json_object"},
    )
    completion = await client.complete(request)
    await client.close()
    assert seen[0]["tools"] == [PYTHON.openai()]
    assert seen[0]["tool_choice"] == {"type": "function", "function": {"name": "python"}}
    assert (seen[0]["seed"], seen[0]["stop"], seen[0]["response_format"]) == (
        3,
        ["END"],
        {"type": "json_object"},
    )
    assert completion.tool_calls == [ToolCall("c1", "python", "{}")]
    assert completion.content == ""
    assert completion.usage == Usage(prompt_tokens=9, cached_tokens=4, completion_tokens=3)
    assert completion.finish_reason is FinishReason.TOOL_CALLS


async def test_a_plain_request_sends_no_tool_fields() -> None:
    seen: list[dict[str, Any]] = []
    client = client_answering(200, {"choices": [{"message": {"content": "ok"}}]}, seen)
    completion = await client.complete(ChatRequest([{"role": "user", "content": "hi"}]))
    assert not {"tools", "tool_choice", "seed", "stop"} & set(seen[0])
    assert (completion.content, completion.usage, completion.finish_reason) == (
        "ok",
        Usage(),
        FinishReason.STOP,
    )


@pytest.mark.parametrize(
    ("status", "body", "problem"),
    [
        (500, "boom", "answered HTTP 500: boom"),
        (200, "not json", "chat/completions"),
        (200, {"choices": []}, "not a chat completion"),
        (200, {"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": "9"}}, "integers"),
    ],
)
async def test_a_bad_answer_is_a_model_error_naming_the_endpoint(
    status: int, body: Any, problem: str
) -> None:
    client = client_answering(status, body, [])
    with pytest.raises(ModelError, match=problem):
        await client.complete(ChatRequest([{"role": "user", "content": "hi"}]))


async def test_an_unreachable_endpoint_is_named() -> None:
    client = OpenAIClient("http://127.0.0.1:9/v1", "m", timeout_s=2)
    with pytest.raises(ModelError, match=r"no server answers at http://127\.0\.0\.1:9/v1"):
        await client.check_reachable()
    with pytest.raises(ModelError, match="no server answers"):
        await client.complete(ChatRequest([{"role": "user", "content": "hi"}]))


@pytest.mark.parametrize(("url", "concurrency"), [("model.test/v1", 1), ("http://model.test/v1", 0)])
def test_bad_settings_are_refused(url: str, concurrency: int) -> None:
    with pytest.raises(ConfigError):
        OpenAIClient(url, "m", concurrency=concurrency)


async def test_a_call_block_left_in_the_content_reaches_the_caller_as_a_call() -> None:
    content = 'Running it.<tool_call>{"name": "python", "arguments": {"code": 1</tool_call>'
    body = {"choices": [{"message": {"content": content}, "finish_reason": "stop"}]}
    with_tools = await client_answering(200, body, []).complete(
        ChatRequest([{"role": "user", "content": "hi"}], tools=(PYTHON,))
    )
    assert with_tools.content == "Running it."
    assert [call.name for call in with_tools.tool_calls] == [MALFORMED_TOOL]
    assert with_tools.finish_reason is FinishReason.TOOL_CALLS
    without = await client_answering(200, body, []).complete(ChatRequest([{"role": "user", "content": "hi"}]))
    assert (without.content, without.tool_calls) == (content, [])
