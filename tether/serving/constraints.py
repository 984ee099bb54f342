"""What a chat request's output must follow, stated as the engine's `StructuredOutput`: the
`response_format` (any JSON object, or JSON valid for a schema) and the tool-call syntax with each tool's
arguments schema: calls only when `tool_choice` is `required` or names a function, free prose around
calls under `auto`.

Pure: schemas are checked here (a 400 naming the field, before the engine sees them) and grammars are
compiled once by llguidance only to prove they can be enforced; the engine enforces them while decoding.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
from llguidance import LLMatcher

from tether.chat import JsonDict, ToolSpec
from tether.chat.tool_format import ToolFormat
from tether.engine.structured import StructuredOutput
from tether.serving.openai_api import APIError, JsonObjectFormat, JsonSchemaFormat, ResponseFormat

NO_ARGUMENTS: JsonDict = {"type": "object", "properties": {}}
# Arguments come out as `ToolFormat.call_text` writes them back in the history (json.dumps' separators)
# and without optional whitespace, so that a model cannot fill its budget with blanks; a tool's schema
# may override these through its own "x-guidance".
ARGUMENT_LAYOUT: JsonDict = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def check_schema(schema: Any, param: str) -> None:
    """A 400 naming `param` unless `schema` is a JSON schema (by the meta-schema of its `$schema`)."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{param}: expected a JSON schema object, got {type(schema).__name__}", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(part) for part in error.absolute_path)
        at = f" at {where!r}" if where else ""
        raise APIError(400, f"{param}: not a valid JSON schema{at}: {error.message}", param) from None


def _enforceable(structured: StructuredOutput, param: str) -> StructuredOutput:
    """`structured`, once llguidance compiled it: what it cannot compile is a 400 naming `param`."""
    if structured.kind == "lark":
        grammar = LLMatcher.grammar_from_lark(structured.spec)
    else:
        grammar = LLMatcher.grammar_from_json_schema(structured.spec or '{"type": "object"}')
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise APIError(400, f"{param}: cannot be enforced while decoding: {messages[0]}", param)
    return structured


def response_constraint(response_format: ResponseFormat | None) -> StructuredOutput | None:
    """The grammar of `response_format`; None for text."""
    if isinstance(response_format, JsonObjectFormat):
        return StructuredOutput("json_object")
    if isinstance(response_format, JsonSchemaFormat):
        schema = response_format.json_schema.json_schema
        param = "response_format.json_schema.schema"
        check_schema(schema, param)
        return _enforceable(StructuredOutput("json_schema", json.dumps(schema)), param)
    return None


def _literal(text: str) -> str:
    """`text` as a Lark string literal (llguidance reads JSON string escapes)."""
    return json.dumps(text)


def _laid_out(schema: JsonDict) -> str:
    """`schema` as JSON text, with `ARGUMENT_LAYOUT` under what its own "x-guidance" states."""
    own = schema.get("x-guidance")
    return json.dumps({**schema, "x-guidance": {**ARGUMENT_LAYOUT, **(own if isinstance(own, dict) else {})}})


def tool_call_grammar(
    tools: list[ToolSpec],
    fmt: ToolFormat,
    *,
    parallel: bool,
    prose: bool = False,
    alternative: JsonDict | None = None,
) -> str:
    """A Lark grammar of calls of `tools` written as `fmt.call_text` writes them, arguments valid for the
    tool's schema: one call, or up to one per tool when `parallel` (small models repeat a call until
    their budget runs out when a grammar lets them). With `prose`, free text may stand around and
    instead of calls, but every opening tag it writes starts a valid call (a lazy lexeme ends the text at
    the tag); with `alternative`, a JSON value valid for that schema may stand instead of calls."""
    assert tools, "a tool call grammar needs a tool"
    assert "/" not in fmt.call_open, "the opening tag is written into a regular expression"
    most = len(tools) if parallel else 1
    names = " | ".join(f"tool_{index}" for index in range(len(tools)))
    closing = _literal("\n" + fmt.call_close)
    if prose:
        rules = [
            "%llguidance {}",
            f"start: call{{0,{most}}} tail",
            "tail: PROSE",
            f"PROSE: /(.|\\n)*/ & ~/(.|\\n)*{re.escape(fmt.call_open)}(.|\\n)*/",
            f"opening[lazy]: PROSE {_literal(fmt.call_open)}",
            f'call: opening "\\n" ({names}) {closing}',
        ]
    else:
        calls = f'call ("\\n" call){{0,{most - 1}}}' if most > 1 else "call"
        rules = [
            "%llguidance {}",
            f"start: {calls}" + (" | answer" if alternative is not None else ""),
            f'call: {_literal(fmt.call_open)} "\\n" ({names}) {closing}',
        ]
    for index, tool in enumerate(tools):
        head = '{"name": ' + json.dumps(tool.name) + ', "arguments": '
        rules.append(f'tool_{index}: {_literal(head)} %json {_laid_out(tool.parameters)} "}}"')
    if alternative is not None:
        rules.append(f"answer: %json {_laid_out(alternative)}")
    return "\n".join(rules) + "\n"


def tool_constraint(
    tools: list[ToolSpec],
    fmt: ToolFormat,
    *,
    only: str | None = None,
    parallel: bool,
    prose: bool = False,
    alternative: JsonDict | None = None,
) -> StructuredOutput:
    """The grammar of `tool_call_grammar` over `tools` (only the one named `only`, when given), proven
    enforceable: a tool schema that llguidance cannot compile is a 400 naming that tool's parameters."""
    chosen = [(index, tool) for index, tool in enumerate(tools) if only is None or tool.name == only]
    for index, tool in chosen:
        param = f"tools.{index}.function.parameters"
        _enforceable(StructuredOutput("json_schema", json.dumps(tool.parameters)), param)
    grammar = tool_call_grammar(
        [tool for _, tool in chosen], fmt, parallel=parallel, prose=prose, alternative=alternative
    )
    return _enforceable(StructuredOutput("lark", grammar), "tools")
