"""Tool calling and structured output against `tether serve` on the real SmolLM2, over a real socket:
the official openai client (whole and streamed), the OpenAI Agents SDK running a two-tool agent, and
langchain-openai's `bind_tools`.

Where a call must come out, `tool_choice` is `required` or names the tool: decoding is then constrained
to the call syntax and each tool's schema, so the call is valid whatever the model's quality; what the
model says in prose is not asserted.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

MODEL = "smollm2-135m-instruct"

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
    "additionalProperties": False,
}
ADD_PARAMETERS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "add": ADD_PARAMETERS}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": SCHEMAS[name]},
    }
    for name, description in [
        ("get_weather", "The current weather in a city."),
        ("add", "Adds two integers."),
    ]
]
QUESTION: list[Any] = [{"role": "user", "content": "What is the weather in Paris? And what is 2 + 3?"}]


@pytest.fixture
def client(smollm2_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_url, api_key="unused", max_retries=0, timeout=120)


def assert_valid_call(name: str, arguments: str) -> dict[str, Any]:
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, SCHEMAS[name])
    return dict(parsed)


def test_named_tool_call_whole_and_streamed(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": QUESTION,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "temperature": 0,
        "max_completion_tokens": 60,
    }
    reply = client.chat.completions.create(**fields)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].function.name == "add"
    assert_valid_call("add", calls[0].function.arguments)

    chunks = list(client.chat.completions.create(**fields, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert "<tool_call>" not in content and content.strip() == ""
    assert [(call.index, call.function and call.function.name) for call in streamed] == [(0, "add")]
    assert (
        streamed[0].id
        and streamed[0].function
        and streamed[0].function.arguments == calls[0].function.arguments
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_gives_calls_valid_for_their_schemas(
    client: openai.OpenAI, parallel: bool
) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=0,
        max_completion_tokens=120,
    )
    calls = reply.choices[0].message.tool_calls or []
    assert 1 <= len(calls) <= (2 if parallel else 1), calls
    for call in calls:
        assert call.type == "function"
        assert_valid_call(call.function.name, call.function.arguments)
    assert len({call.id for call in calls}) == len(calls)
    assert reply.choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_answers_in_prose(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=30
    )
    message = reply.choices[0].message
    assert not message.tool_calls and message.content and "<tool_call>" not in message.content


def test_tool_results_continue_the_conversation(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=40,
    )
    message = first.choices[0].message
    calls = message.tool_calls or []
    history: list[Any] = [
        *QUESTION,
        message.model_dump(exclude_none=True),
        *[{"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"} for call in calls],
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=30
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage is not None and second.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens and details.cached_tokens > 0  # the shared prefix


def test_json_schema_response_format_output_validates(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    }
    fields: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
        "temperature": 0,
        "max_tokens": 100,
        "seed": 1,
    }
    whole = client.chat.completions.create(**fields).choices[0].message.content or ""
    jsonschema.validate(json.loads(whole), schema)
    stream = client.chat.completions.create(**fields, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole
    sampled = client.chat.completions.create(**{**fields, "temperature": 1.0, "n": 3})
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_json_object_response_format_gives_an_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A JSON object with your name."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
