"""The playground's way to a model: list a server's models, and stream a chat reply's text as it arrives,
from any OpenAI-compatible base URL (`.../v1`). The request body is `openai_client.request_body`'s, with
`stream` on; the key, if any, is sent from here and never reaches the browser. A refusal, an error status
or a dropped connection is a `ModelError` that names the server and says what it answered."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

from tether.chat.completion import ChatRequest, ModelError
from tether.chat.openai_client import request_body

LIST_TIMEOUT_S = 3.0
# Connecting must be quick; a reply's tokens may be slow to come (a big model, a long prompt).
STREAM_TIMEOUT = httpx.Timeout(600.0, connect=5.0)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _refusal(url: str, response: httpx.Response, body: bytes) -> ModelError:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", errors="replace")[:500]
    return ModelError(f"{url} answered HTTP {response.status_code}: {message}")


async def list_models(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> list[str]:
    url = f"{base_url.rstrip('/')}/models"
    try:
        response = await client.get(url, headers=_headers(api_key), timeout=LIST_TIMEOUT_S)
    except httpx.HTTPError as error:
        raise ModelError(f"no server answers at {url} ({type(error).__name__})") from None
    if response.status_code != 200:
        raise _refusal(url, response, response.content)
    try:
        return [str(card["id"]) for card in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise ModelError(f"{url} did not answer a model list") from None


def _delta_text(line: str) -> str | None:
    """The text of one `data:` line of a chat completion stream; None for anything else."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]" or not data:
        return None
    try:
        event = json.loads(data)
    except ValueError:
        return None
    if isinstance(event, dict) and "error" in event:
        error = event["error"]
        raise ModelError(str(error.get("message", error)) if isinstance(error, dict) else str(error))
    try:
        text = event["choices"][0]["delta"].get("content")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    return text if isinstance(text, str) and text else None


async def stream_reply(
    client: httpx.AsyncClient, base_url: str, api_key: str | None, model: str, request: ChatRequest
) -> AsyncIterator[str]:
    """The reply's text, piece by piece as the server streams it."""
    url = f"{base_url.rstrip('/')}/chat/completions"
    body = {**request_body(model, request), "stream": True}
    try:
        async with client.stream(
            "POST", url, json=body, headers=_headers(api_key), timeout=STREAM_TIMEOUT
        ) as response:
            if response.status_code != 200:
                raise _refusal(url, response, await response.aread())
            async for line in response.aiter_lines():
                text = _delta_text(line)
                if text is not None:
                    yield text
    except httpx.HTTPError as error:
        raise ModelError(f"no server answers at {url} ({type(error).__name__}: {error})") from None
