"""Chat requests with tools, tool messages and response formats: every bad one is a 400 naming the field,
and a good one becomes the conversation, tools and grammar the engine runs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz import assert_client_error_or_success, encode, mutated_bodies
from tests.serving.conftest import CHAT, MODEL, chat, send_sync, sse_events
from tether.chat.tool_format import HERMES
from tether.engine.async_engine import AsyncEngine
from tether.engine.llm_engine import LLMEngine
from tether.serving.app import create_app
from tether.serving.chat import ToolMode, plan_chat
from tether.serving.openai_api import ChatCompletionRequest

ADD_PARAMETERS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD_PARAMETERS}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
HISTORY = [
    {"role": "user", "content": "1 + 2?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
]


@pytest.fixture(scope="module")
def served(tiny_path: Path) -> Iterator[tuple[AsyncEngine, FastAPI]]:
    """A context long enough for the tools' description in the system prompt (bytes, for this tokenizer)."""
    engine, tokenizer = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=8, max_model_len=2048)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    yield async_engine, create_app(async_engine, tokenizer, MODEL)
    async_engine.shutdown()


def with_tools(**fields: Any) -> dict[str, Any]:
    return chat(tools=[ADD], **fields)


def tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", **function}}


BAD_CHATS: list[tuple[str, dict[str, Any], str]] = [
    ("tool-without-name", chat(tools=[{"type": "function", "function": {}}]), "tools.0.function.name"),
    ("tool-name-with-spaces", chat(tools=[tool(name="two words")]), "tools.0.function.name"),
    ("tool-not-a-function", chat(tools=[{"type": "retrieval"}]), "tools.0.type"),
    ("tool-unknown-key", chat(tools=[tool(returns="int")]), "tools.0.function.returns"),
    (
        "tool-schema-bad-type",
        chat(tools=[tool(parameters={"type": "objekt"})]),
        "tools.0.function.parameters",
    ),
    (
        "tool-schema-bad-keyword",
        chat(tools=[ADD, tool(parameters={"type": "object", "required": "a"})]),
        "tools.1.function.parameters",
    ),
    (
        "tool-schema-not-object",
        chat(tools=[tool(parameters={"type": "array"})]),
        "tools.0.function.parameters",
    ),
    ("tool-schema-not-a-dict", chat(tools=[tool(parameters=[1])]), "tools.0.function.parameters"),
    ("tool-declared-twice", chat(tools=[ADD, ADD]), "tools.1.function.name"),
    ("tool-choice-unknown-word", with_tools(tool_choice="sometimes"), "tool_choice"),
    (
        "tool-choice-unknown-tool",
        with_tools(tool_choice={"type": "function", "function": {"name": "multiply"}}),
        "tool_choice.function.name",
    ),
    ("tool-choice-named-without-name", with_tools(tool_choice={"type": "function"}), "tool_choice.function"),
    ("tool-choice-required-without-tools", chat(tool_choice="required"), "tool_choice"),
    ("parallel-not-a-bool", with_tools(parallel_tool_calls="maybe"), "parallel_tool_calls"),
    (
        "tool-message-without-id",
        {**chat(), "messages": [*HISTORY[:2], {"role": "tool", "content": "3"}]},
        "messages.2.tool_call_id",
    ),
    (
        "tool-message-answering-no-call",
        {**chat(), "messages": [*HISTORY[:2], {"role": "tool", "tool_call_id": "call_9", "content": "3"}]},
        "messages.2.tool_call_id",
    ),
    (
        "tool-message-before-its-call",
        {**chat(), "messages": [HISTORY[0], HISTORY[2], HISTORY[1]]},
        "messages.1.tool_call_id",
    ),
    (
        "tool-calls-on-a-user-message",
        {**chat(), "messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]},
        "messages.0.tool_calls",
    ),
    (
        "tool-call-id-on-a-user-message",
        {**chat(), "messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]},
        "messages.0.tool_call_id",
    ),
    (
        "tool-call-arguments-not-json",
        {
            **chat(),
            "messages": [
                HISTORY[0],
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "add", "arguments": "{a:"}}],
                },
            ],
        },
        "messages.1.tool_calls.0.function.arguments",
    ),
    (
        "tool-call-arguments-not-an-object",
        {
            **chat(),
            "messages": [
                HISTORY[0],
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "add", "arguments": "[1]"}}],
                },
            ],
        },
        "messages.1.tool_calls.0.function.arguments",
    ),
    (
        "tool-call-without-id",
        {
            **chat(),
            "messages": [
                {"role": "assistant", "tool_calls": [{"type": "function", "function": CALL["function"]}]}
            ],
        },
        "messages.0.tool_calls.0.id",
    ),
    ("response-format-unknown-type", chat(response_format={"type": "xml"}), "response_format"),
    (
        "response-format-schema-without-name",
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}),
        "response_format.json_schema.name",
    ),
    (
        "response-format-bad-schema",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": 3}}}),
        "response_format.json_schema.schema",
    ),
    (
        "response-format-unenforceable-schema",
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#/x"}}}
        ),
        "response_format.json_schema.schema",
    ),
    (
        "response-format-surrogate-in-schema",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"\ud800": {}}}}),
        "response_format.json_schema.schema",
    ),
    (
        "surrogate-in-tool-schema",
        chat(tools=[tool(parameters={"enum": ["\udfff"]})]),
        "tools.0.function.parameters",
    ),
]


@pytest.mark.parametrize(
    ("body", "param"), [case[1:] for case in BAD_CHATS], ids=[case[0] for case in BAD_CHATS]
)
async def test_bad_chat_request_is_a_400_naming_the_field(
    client: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    response = await client.post(CHAT, content=encode(body), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param in error["message"], error


async def test_history_with_calls_and_results_is_accepted(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json={**with_tools(), "messages": HISTORY})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**with_tools(), **fields})


def test_tool_choice_defaults_to_auto_with_tools_and_every_call_is_constrained() -> None:
    auto = plan_chat(request(), HERMES)
    assert auto.mode is ToolMode.AUTO and auto.reads_calls
    assert auto.structured is not None and "PROSE" in auto.structured.spec
    assert [spec.name for spec in auto.tools] == ["add"]
    required = plan_chat(request(tool_choice="required"), HERMES)
    named = plan_chat(request(tool_choice={"type": "function", "function": {"name": "add"}}), HERMES)
    for plan in (required, named):
        assert plan.structured is not None and plan.structured.kind == "lark"
        assert '\\"add\\"' in plan.structured.spec and '"required": ["a", "b"]' in plan.structured.spec


def test_tool_choice_none_hides_the_tools_and_reads_no_calls() -> None:
    plan = plan_chat(request(tool_choice="none"), HERMES)
    assert plan.mode is ToolMode.NONE and plan.tools == () and not plan.reads_calls


def test_auto_with_a_response_format_admits_calls_or_the_answer() -> None:
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "sum", "schema": schema}}
    plan = plan_chat(request(response_format=fmt), HERMES)
    assert plan.structured is not None and plan.structured.kind == "lark"
    assert "| answer" in plan.structured.spec and '"sum"' in plan.structured.spec
    alone = plan_chat(request(response_format=fmt, tool_choice="none"), HERMES)
    assert alone.structured is not None and alone.structured.kind == "json_schema"


def test_history_becomes_tether_chat_messages() -> None:
    messages = plan_chat(
        request(messages=[{"role": "developer", "content": "be brief"}, *HISTORY]), HERMES
    ).messages
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[2]["tool_calls"] == [CALL] and messages[3]["tool_call_id"] == "call_1"


# Every new part of a chat body, mutated where it nests: the property is that the answer is a completion
# or a 4xx naming the problem, never a 5xx. Two tokens each: constrained or not, generation is not the point.
FUZZ_EXAMPLE: dict[str, Any] = {
    **chat(),
    "max_tokens": 2,
    "messages": [{"role": "system", "content": "s"}, *HISTORY],
    "tools": [ADD],
    "tool_choice": {"type": "function", "function": {"name": "add"}},
    "parallel_tool_calls": False,
    "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": ADD_PARAMETERS}},
    "logprobs": True,
    "top_logprobs": 2,
}
PLACES: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], Callable[..., dict[str, Any]]]] = {
    "body": (lambda body: body, lambda body, part: part),
    "tool": (lambda body: body["tools"][0], lambda body, part: {**body, "tools": [part]}),
    "function": (
        lambda body: body["tools"][0]["function"],
        lambda body, part: {**body, "tools": [{"type": "function", "function": part}]},
    ),
    "schema": (lambda body: ADD_PARAMETERS, lambda body, part: {**body, "tools": [tool(parameters=part)]}),
    "tool-choice": (lambda body: body["tool_choice"], lambda body, part: {**body, "tool_choice": part}),
    "call-message": (
        lambda body: body["messages"][2],
        lambda body, part: {**body, "messages": [*body["messages"][:2], part, body["messages"][3]]},
    ),
    "call": (
        lambda body: CALL,
        lambda body, part: {
            **body,
            "messages": [*body["messages"][:2], {"role": "assistant", "tool_calls": [part]}],
        },
    ),
    "tool-message": (
        lambda body: body["messages"][3],
        lambda body, part: {**body, "messages": [*body["messages"][:3], part]},
    ),
    "response-format": (
        lambda body: body["response_format"],
        lambda body, part: {**body, "response_format": part},
    ),
    "json-schema": (
        lambda body: body["response_format"]["json_schema"],
        lambda body, part: {**body, "response_format": {"type": "json_schema", "json_schema": part}},
    ),
}


def test_fuzzed_tool_and_format_fields_get_a_client_error_or_a_completion(
    served: tuple[AsyncEngine, FastAPI],
) -> None:
    app = served[1]

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(place=st.sampled_from(sorted(PLACES)), data=st.data())
    def property(place: str, data: st.DataObject) -> None:
        part_of, put = PLACES[place]
        body = put(FUZZ_EXAMPLE, data.draw(mutated_bodies(part_of(FUZZ_EXAMPLE))))
        if place == "body" and body.get("max_tokens") is None:
            body = {**body, "max_tokens": 2}
        response = send_sync(app, CHAT, encode(body))
        assert_client_error_or_success(response.status_code, response.content, route=f"{CHAT} ({place})")

    property()


async def test_model_without_a_chat_template_serves_text_and_refuses_chats(
    served: tuple[AsyncEngine, FastAPI], tiny_path: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    tokenizer.chat_template = None
    app = create_app(served[0], tokenizer, MODEL)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        refused = await client.post(CHAT, json=chat())
        text = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
    assert "no chat template" in refused.json()["error"]["message"]
    assert text.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_required_call_from_a_random_model_is_valid_for_its_schema(
    client: httpx.AsyncClient, stream: bool
) -> None:
    small = {"type": "integer", "minimum": 0, "maximum": 99}
    schema = {**ADD_PARAMETERS, "properties": {"a": small, "b": small}, "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "add", "parameters": schema}}]
    body = chat(
        tools=tools, tool_choice="required", max_tokens=120, temperature=1.0, seed=7, n=2, stream=stream
    )
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = sse_events(response.text)
        content = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        calls = [
            (c["index"], call)
            for e in events
            for c in e["choices"]
            for call in c["delta"].get("tool_calls", [])
        ]
        reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert content == "" and sorted(index for index, _ in calls) == [0, 1]
        entries = [call for _, call in calls]
    else:
        choices = response.json()["choices"]
        assert all(choice["message"]["content"] is None for choice in choices)
        reasons = [choice["finish_reason"] for choice in choices]
        entries = [call for choice in choices for call in choice["message"]["tool_calls"]]
    assert reasons == ["tool_calls", "tool_calls"]
    for entry in entries:
        assert entry["type"] == "function" and entry["function"]["name"] == "add"
        jsonschema.validate(json.loads(entry["function"]["arguments"]), schema)
