"""OpenAI's request schemas for chat and text completions, and errors in OpenAI's error format.

Pure data and validation: the HTTP app (`server.py`) parses requests with these models and answers
every problem as `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import re
from typing import Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(GenerationRequest):
    prompt: str | list[int]
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

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}},
            status_code=self.status,
        )


SAMPLING_FIELD = re.compile(r"^sampling: (\w+) =")


def validation_error(error: RequestValidationError) -> APIError:
    problems = []
    param = None
    for problem in error.errors():
        location = [str(part) for part in problem.get("loc", ()) if part != "body"]
        if problem.get("type") == "json_invalid":
            problems.append(f"the body is not valid JSON: {problem.get('ctx', {}).get('error', '')}")
            continue
        if not location:
            problems.append("the body must be a JSON object")
            continue
        name = ".".join(location) or "body"
        param = param or name
        problems.append(f"{name}: {problem.get('msg')} (got {problem.get('input')!r})")
    return APIError(400, "; ".join(problems) or "invalid request", param)
