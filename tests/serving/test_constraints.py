"""The grammars a chat request's output must follow, run through llguidance over SmolLM2's real
vocabulary: what a grammar accepts is what the engine lets the model write."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tether.chat import ToolCall, ToolSpec
from tether.chat.tool_format import HERMES
from tether.engine.structured import StructuredOutput
from tether.serving.constraints import check_schema, response_constraint, tool_constraint
from tether.serving.openai_api import APIError, JsonObjectFormat, JsonSchemaFormat, TextFormat

WEATHER = ToolSpec(
    "get_weather",
    "The weather in a city.",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
ADD = ToolSpec(
    "add",
    "a + b",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
)
WEATHER_CALL = HERMES.call_text(ToolCall("1", "get_weather", '{"city": "Paris", "unit": "C"}'))
ADD_CALL = HERMES.call_text(ToolCall("2", "add", '{"a": 1, "b": 2}'))


@pytest.fixture(scope="module")
def tokenizer(smollm2_folder: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(smollm2_folder)


@pytest.fixture(scope="module")
def vocabulary(tokenizer: PreTrainedTokenizerBase) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(tokenizer)  # type: ignore[arg-type]


def accepts(
    structured: StructuredOutput,
    text: str,
    tokenizer: PreTrainedTokenizerBase,
    vocabulary: llguidance.LLTokenizer,
) -> bool:
    assert structured.kind == "lark"
    matcher = llguidance.LLMatcher(vocabulary, llguidance.LLMatcher.grammar_from_lark(structured.spec))
    return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()


@pytest.mark.parametrize(
    ("parallel", "only", "text", "accepted"),
    [
        (True, None, WEATHER_CALL, True),
        (True, None, f"{WEATHER_CALL}\n{ADD_CALL}", True),
        (False, None, f"{WEATHER_CALL}\n{ADD_CALL}", False),
        (False, None, ADD_CALL, True),
        (True, None, f"{WEATHER_CALL}\n{ADD_CALL}\n{ADD_CALL}", False),  # more calls than tools
        (True, "add", ADD_CALL, True),
        (True, "add", WEATHER_CALL, False),
        (True, None, WEATHER_CALL.replace('"C"', '"K"'), False),  # not in the enum
        (True, None, WEATHER_CALL.replace(', "unit": "C"', ""), False),  # a required key missing
        (True, None, ADD_CALL.replace("1", '"1"'), False),  # a string for an integer
        (True, None, "Sure! " + WEATHER_CALL, False),  # prose where a call must be
        (True, None, '{"city": "Paris"}', False),
    ],
)
def test_tool_grammar_admits_exactly_calls_valid_for_the_tool_schemas(
    tokenizer: PreTrainedTokenizerBase,
    vocabulary: llguidance.LLTokenizer,
    parallel: bool,
    only: str | None,
    text: str,
    accepted: bool,
) -> None:
    structured = tool_constraint([WEATHER, ADD], HERMES, only=only, parallel=parallel)
    assert accepts(structured, text, tokenizer, vocabulary) is accepted


@pytest.mark.parametrize(
    ("parallel", "text", "accepted"),
    [
        (True, "Just prose, no call at all.", True),
        (True, "a < b, and <tool is no tag", True),
        (True, f"Let me look.\n{WEATHER_CALL}", True),
        (True, f"{WEATHER_CALL}\n{ADD_CALL}\nDone.", True),
        (False, f"{WEATHER_CALL}\n{ADD_CALL}", False),
        (False, f"One call: {ADD_CALL} and prose after it", True),
        (True, f"{WEATHER_CALL}\n{ADD_CALL}\n{ADD_CALL}", False),  # more calls than tools
        (True, "Sure: <tool_call> whatever", False),  # an opened call must be one
        (True, WEATHER_CALL.replace('"C"', '"K"'), False),
        (True, ADD_CALL.replace('"add"', '"multiply"'), False),  # no such tool
    ],
)
def test_prose_grammar_leaves_text_free_but_every_opened_call_valid(
    tokenizer: PreTrainedTokenizerBase,
    vocabulary: llguidance.LLTokenizer,
    parallel: bool,
    text: str,
    accepted: bool,
) -> None:
    structured = tool_constraint([WEATHER, ADD], HERMES, parallel=parallel, prose=True)
    assert accepts(structured, text, tokenizer, vocabulary) is accepted


def test_tool_grammar_with_an_alternative_also_admits_the_answer(
    tokenizer: PreTrainedTokenizerBase, vocabulary: llguidance.LLTokenizer
) -> None:
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    structured = tool_constraint([ADD], HERMES, parallel=True, alternative=answer)
    assert accepts(structured, '{"ok": true}', tokenizer, vocabulary)
    assert accepts(structured, ADD_CALL, tokenizer, vocabulary)
    assert not accepts(structured, '{"ok": 1}', tokenizer, vocabulary)


def test_a_call_the_grammar_admits_parses_back_to_the_same_call() -> None:
    parsed = HERMES.parse(f"{WEATHER_CALL}\n{ADD_CALL}")
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert not parsed.malformed and parsed.content == ""


def test_response_formats_map_to_structured_outputs() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    spec = JsonSchemaFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    )
    assert response_constraint(spec) == StructuredOutput("json_schema", json.dumps(schema))
    assert response_constraint(JsonObjectFormat(type="json_object")) == StructuredOutput("json_object")
    assert response_constraint(TextFormat(type="text")) is None
    assert response_constraint(None) is None


@pytest.mark.parametrize(
    "schema",
    [{"type": "objekt"}, {"properties": {"a": {"type": 5}}}, {"required": "a"}, {"enum": 3}, [1]],
)
def test_bad_schema_is_a_400_naming_the_field(schema: object) -> None:
    with pytest.raises(APIError) as raised:
        check_schema(schema, "tools.0.function.parameters")
    assert raised.value.status == 400 and raised.value.param == "tools.0.function.parameters"
    assert "tools.0.function.parameters" in raised.value.message


def test_schema_llguidance_cannot_enforce_is_a_400_naming_the_tool() -> None:
    unenforceable = ToolSpec("f", "", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    with pytest.raises(APIError) as raised:
        tool_constraint([ADD, unenforceable], HERMES, parallel=True)
    assert raised.value.param == "tools.1.function.parameters"
    assert "cannot be enforced" in raised.value.message
