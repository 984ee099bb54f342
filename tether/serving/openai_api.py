"""OpenAI's request schemas for chat and text completions, and errors in OpenAI's error format.

Pure data and shape validation: the HTTP app (`app.py`) parses requests with these models and answers
every problem as `{"error": {"message", "type", "param", "code"}}`; what needs more than one field (a
tool message answering an earlier call, a `tool_choice` naming a declared tool) is checked in `chat.py`.
Fields the models do not declare (penalties, logit_bias, audio, ...) are refused as not supported.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, field_validator

from tether.errors import lone_surrogate
from tether.web import AsciiJSONResponse


def _lone_surrogate(value: object, where: str = "", deep: bool = False) -> str | None:
    """Where a string of `value` (a string or a list of them; `deep`: any JSON value, keys included)
    holds a lone UTF-16 surrogate, if any."""
    if isinstance(value, str):
        found = lone_surrogate(value)
        if found is None or not where:
            return found
        return f"{found} (in {where.rstrip(', ')})"
    items: list[tuple[str, object]] = []
    if isinstance(value, list):
        items = [(f"item {index}, ", item) for index, item in enumerate(value)]
        if not deep:  # the items of a list of models are checked by the models' own validator
            items = [(place, item) for place, item in items if isinstance(item, str)]
    elif isinstance(value, dict) and deep:
        items = [(f"key {_quote(key)}, ", key) for key in value]
        items += [(f"{_quote(key)}: ", item) for key, item in value.items()]
    for place, item in items:
        found = _lone_surrogate(item, where + place, deep)
        if found is not None:
            return found
    return None


def _json_type(value: object) -> str:
    return "list" if isinstance(value, list) else "str"


# A string or a list, told apart by the JSON type sent: a refusal then names only the branch that applies
# (the tag is left out of its location, see `validation_error`).
StrOrTokens = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[int], Tag("list")], Discriminator(_json_type)
]


class _Request(BaseModel):
    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: object) -> object:
        """Strings must be Unicode text: a lone surrogate is valid JSON (an escape such as `\\ud800`) but
        no character, which neither the tokenizer nor a response could encode."""
        found = _lone_surrogate(value)
        if found is not None:
            raise ValueError(f"holds {found}")
        return value


class _Strict(_Request):
    model_config = ConfigDict(extra="forbid")


def _valid_json_text(value: object) -> object:
    """A free JSON value (a schema) must hold only Unicode text too: it becomes part of the prompt."""
    found = _lone_surrogate(value, deep=True)
    if found is not None:
        raise ValueError(f"holds {found}")
    return value


JsonObject = Annotated[dict[str, Any], BeforeValidator(_valid_json_text)]


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationRequest(_Strict):
    model: str
    max_tokens: int | None = None
    """Default: the rest of the context window."""
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int = -1
    """Extension: -1 means no limit."""
    min_p: float = 0.0
    """Extension."""
    priority: int = 0
    """Extension: higher is served first."""
    ignore_eos: bool = False
    """Extension: keep generating past the end-of-sequence token."""


class ContentPart(_Request):
    type: Literal["text"]
    text: str


# OpenAI's rule for function and response-format names.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionCall(_Request):
    name: str
    arguments: str
    """JSON text, as the model wrote it."""


class ToolCallParam(_Request):
    """A call of an earlier assistant message, sent back in the history."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: (
        Annotated[
            Annotated[str, Tag("str")] | Annotated[list[ContentPart], Tag("list")], Discriminator(_json_type)
        ]
        | None
    ) = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    """Assistant messages only."""
    tool_call_id: str | None = None
    """Tool messages only: the call this message answers."""

    @property
    def text(self) -> str:
        content = self.content
        if isinstance(content, list):
            return "".join(part.text for part in content)
        return content or ""


class FunctionDefinition(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: JsonObject | None = None
    """A JSON schema of the arguments object; absent means a function without arguments."""
    strict: bool | None = None
    """Arguments follow `parameters` exactly; they do whenever decoding is constrained to a call."""


class ToolParam(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    json_schema: JsonObject = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


def _format_type(value: object) -> str:
    return f"{value.get('type')}_format" if isinstance(value, dict) else "json_schema_format"


def _choice_type(value: object) -> str:
    return "function_choice" if isinstance(value, dict) else "str"


# Told apart by `type` (by the JSON type for tool_choice), so that a refusal names only the branch that
# was asked for; the tags are left out of its location (see `validation_error`).
ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("text_format")]
    | Annotated[JsonObjectFormat, Tag("json_object_format")]
    | Annotated[JsonSchemaFormat, Tag("json_schema_format")],
    Discriminator(_format_type),
]
ToolChoice = Annotated[
    Annotated[Literal["auto", "none", "required"], Tag("str")]
    | Annotated[NamedToolChoice, Tag("function_choice")],
    Discriminator(_choice_type),
]


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    """Default: "auto" with tools, "none" without."""
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None


class CompletionRequest(GenerationRequest):
    prompt: StrOrTokens
    logprobs: int | None = None
    echo: bool = False


# errors


class APIError(Exception):
    """A request the server refuses, rendered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> Response:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return AsciiJSONResponse({"error": error}, status_code=self.status)


SAMPLING_FIELD = re.compile(r"^sampling: (\w+) =")


def _quote(value: object) -> str:
    """A bad value as a message quotes it, shortened: a prompt or a nesting can be as large as the body."""
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother = 3, 80, 80
    return short.repr(value)


_UNION_TAGS = ("str", "list", "function_choice", "text_format", "json_object_format", "json_schema_format")


def validation_error(error: RequestValidationError, model: type[BaseModel] | None = None) -> APIError:
    """One 400 naming every problem of a request that `model` (the route's schema) refused; a field it
    does not declare is not supported by this server, and the message then lists the fields that are."""
    problems = []
    param = None
    unsupported = False
    for problem in error.errors():
        location = [str(part) for part in problem.get("loc", ()) if part not in ("body", *_UNION_TAGS)]
        if problem.get("type") == "json_invalid":
            problems.append(f"the body is not valid JSON: {problem.get('ctx', {}).get('error', '')}")
            continue
        if not location:
            problems.append("the body must be a JSON object")
            continue
        name = ".".join(location) or "body"
        param = param or name
        if problem.get("type") == "extra_forbidden":
            unsupported = unsupported or len(location) == 1
            problems.append(f"{name}: not supported by this server")
        elif problem.get("type") == "union_tag_invalid":  # a `type` no branch has
            expected = str(problem.get("ctx", {}).get("expected_tags", "")).replace("_format", "")
            kind = problem.get("input", {}).get("type") if isinstance(problem.get("input"), dict) else None
            problems.append(f"{name}: type {_quote(kind)} is not supported: expected one of {expected}")
        else:
            reason = str(problem.get("msg")).removeprefix("Value error, ")  # pydantic's prefix for ours
            problems.append(f"{name}: {reason} (got {_quote(problem.get('input'))})")
    message = "; ".join(problems) or "invalid request"
    if unsupported and model is not None:
        message += f". Supported fields: {', '.join(model.model_fields)}"
    return APIError(400, message, param)


def route_error(
    method: str, path: str, status: int, detail: str, cause: BaseException | None, endpoints: Sequence[str]
) -> APIError:
    """A refusal before any schema applies: an unknown endpoint or method (naming the supported ones), or
    a body that could not be parsed at all (such as arrays nested past the parser's recursion limit)."""
    if status in (404, 405):
        message = f"{method} {path} is not supported by this server; it serves {', '.join(endpoints)}"
        return APIError(status, message, None, "unsupported_endpoint")
    if isinstance(cause, RecursionError):
        return APIError(status, "the body is nested too deeply to parse as JSON")
    if cause is not None:  # such as bytes that are not UTF-8
        return APIError(status, f"the body is not valid JSON: {cause}")
    return APIError(status, detail)
