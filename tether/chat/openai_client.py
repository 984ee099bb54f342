"""`OpenAIClient`: the `ChatClient` for any OpenAI-compatible `/chat/completions` endpoint (`tether serve`,
vLLM, SGLang, a hosted API), tools sent as OpenAI `tools` and calls read from `tool_calls`.

httpx does the I/O behind one transport, so the in-process engine (`serving/engine_client.py`) and
tests reach an app without a socket. A failure to connect, a non-200 answer or a body that is not a chat
completion is a `ModelError` naming the endpoint; nothing here retries.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tether.chat.completion import ChatRequest, Completion, FinishReason, ModelError, Usage
from tether.chat.messages import ChatError, JsonDict, ToolCall, assistant_message, tool_calls_of
from tether.chat.tool_format import FORMATS
from tether.errors import ConfigError

REACHABLE_TIMEOUT_S = 10.0  # for a server to answer at all before work is spent on it


def request_body(model: str, request: ChatRequest) -> JsonDict:
    """The JSON body of a chat completion request for `model`."""
    body: JsonDict = {
        "model": model,
        "messages": request.messages,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
    }
    if request.seed is not None:
        body["seed"] = request.seed
    if request.stop:
        body["stop"] = list(request.stop)
    if request.response_format is not None:
        body["response_format"] = request.response_format
    if request.tools:
        body["tools"] = request.openai_tools()
        choice = request.tool_choice
        if choice not in ("auto", "none", "required"):
            body["tool_choice"] = {"type": "function", "function": {"name": choice}}
        elif choice != "auto":
            body["tool_choice"] = choice
    return body


def read_completion(payload: Any, tools_offered: bool = False) -> Completion:
    """A `Completion` from a chat completion body; `ChatError` when it is not one.

    With tools offered, call blocks left in the content (a server returns a block its parser could not
    read as text, as vLLM and `tether serve` do) are read with the one tool-call format, so a malformed
    call reaches the caller as a `MALFORMED_TOOL` call it answers, never as a silent final answer."""
    try:
        choice = payload["choices"][0]
        reply = choice["message"]
        content = reply.get("content") or ""
        calls = tool_calls_of(reply)
        usage = Usage.from_openai(payload["usage"]) if payload.get("usage") else Usage()
        reason = choice.get("finish_reason") or "stop"
    except (KeyError, IndexError, TypeError, AttributeError) as error:
        raise ChatError(f"not a chat completion: {error!r}") from None
    fmt = next((f for f in FORMATS.values() if f.call_open in content), None) if tools_offered else None
    if fmt is not None:
        parsed = fmt.parse(content, lambda index: f"call_text_{index}")
        content = parsed.content
        calls += [ToolCall.from_openai(raw) for raw in parsed.message().get("tool_calls", [])]
    message = assistant_message(content, calls)
    known = {member.value for member in FinishReason}
    finish = FinishReason(reason) if reason in known else FinishReason.STOP
    if calls and finish is FinishReason.STOP:
        finish = FinishReason.TOOL_CALLS
    return Completion(message, usage, finish)


class OpenAIClient:
    """POST `{base_url}/chat/completions`; `base_url` ends where that path is appended (`.../v1`)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        concurrency: int = 64,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base url {base_url!r}: expected http(s)://HOST[:PORT]/v1")
        if concurrency < 1:
            raise ConfigError(f"concurrency {concurrency!r}: expected an integer >= 1")
        self.name = model
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout_s, headers=headers, transport=transport
        )
        self._limit = asyncio.Semaphore(concurrency)

    async def check_reachable(self) -> None:
        """Fail once, naming the URL, when no server answers there (any HTTP answer counts, even 404)."""
        try:
            await self._client.get("/models", timeout=REACHABLE_TIMEOUT_S)
        except httpx.TransportError as error:
            raise ModelError(self._unreachable(error)) from None

    def _unreachable(self, error: Exception) -> str:
        return f"no server answers at {self.base_url} ({type(error).__name__}: {error})"

    async def complete(self, request: ChatRequest) -> Completion:
        async with self._limit:
            try:
                response = await self._client.post("/chat/completions", json=request_body(self.name, request))
            except httpx.HTTPError as error:
                raise ModelError(self._unreachable(error)) from None
        if response.status_code != 200:
            url = f"{self.base_url}/chat/completions"
            raise ModelError(f"{url} answered HTTP {response.status_code}: {response.text[:500]}")
        try:
            return read_completion(response.json(), tools_offered=bool(request.tools))
        except (ValueError, ChatError) as error:
            raise ModelError(f"{self.base_url}/chat/completions: {error}") from None

    async def close(self) -> None:
        await self._client.aclose()
