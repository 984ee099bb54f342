"""One request to a model and what comes back, and the `ChatClient` protocol every model seam speaks.

Adapters: `tether.chat.openai_client.OpenAIClient` (any OpenAI-compatible endpoint: `tether serve`, vLLM,
SGLang, a hosted API), the in-process engine (`tether.serving.engine_client.EngineClient`) and a
scripted client for tests (`tether.testing.scripted.ScriptedClient`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from tether.chat.messages import ChatError, JsonDict, Message, Messages, ToolCall, ToolSpec, tool_calls_of


class FinishReason(StrEnum):
    """Why a completion ended, as OpenAI's `finish_reason` spells it (abort and error are ours)."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    ABORT = "abort"
    ERROR = "error"


class ModelError(ChatError):
    """The model could not be reached, or answered something that is not a chat completion."""


class BadUsage(ChatError, ValueError):
    """A `usage` object that is missing or inconsistent."""


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one completion; `cached_tokens` of the prompt came from the prefix cache."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def __post_init__(self) -> None:
        if min(self.prompt_tokens, self.cached_tokens, self.completion_tokens) < 0:
            raise BadUsage(f"usage {self}: token counts must be >= 0")
        if self.cached_tokens > self.prompt_tokens:
            raise BadUsage(f"usage {self}: cached_tokens exceeds prompt_tokens")

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def openai(self) -> JsonDict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    @classmethod
    def from_openai(cls, usage: Any) -> Usage:
        """From an OpenAI `usage` object; `prompt_tokens_details.cached_tokens` may be absent (0)."""
        if not isinstance(usage, dict):
            raise BadUsage(f"usage {usage!r}: expected an object")
        details = usage.get("prompt_tokens_details") or {}
        values = (
            usage.get("prompt_tokens"),
            details.get("cached_tokens", 0) or 0,
            usage.get("completion_tokens"),
        )
        if not all(isinstance(value, int) and not isinstance(value, bool) for value in values):
            raise BadUsage(
                f"usage {usage!r}: prompt_tokens, completion_tokens and cached_tokens must be integers"
            )
        return cls(*values)  # type: ignore[arg-type]  # checked just above


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """The next assistant turn of `messages`. `tool_choice`: "auto", "none", "required" or a tool name;
    `response_format`: OpenAI's object ({"type": "json_object"} or {"type": "json_schema", ...})."""

    messages: Messages
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str = "auto"
    max_tokens: int = 512
    temperature: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    response_format: JsonDict | None = None
    step_no: int = 0  # which step of a task asks (scripted replies and idempotent replays key on it)

    def openai_tools(self) -> list[JsonDict]:
        return [tool.openai() for tool in self.tools]


@dataclass(frozen=True, slots=True)
class Completion:
    """One assistant reply; token ids and logprobs when the client can see them (the in-process engine)."""

    message: Message
    usage: Usage = field(default_factory=Usage)
    finish_reason: FinishReason = FinishReason.STOP
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()

    @property
    def content(self) -> str:
        content = self.message.get("content")
        return content if isinstance(content, str) else ""

    @property
    def tool_calls(self) -> list[ToolCall]:
        return tool_calls_of(self.message)


class ChatClient(Protocol):
    """A model reached for one assistant turn at a time; `close` releases what it holds."""

    name: str

    async def complete(self, request: ChatRequest) -> Completion: ...

    async def close(self) -> None: ...
