"""The chat playground: a conversation with any model of the console's `model_urls`, its reply streamed
into the page token by token.

A turn is an htmx POST that returns the user's message and an empty reply bubble connected (htmx's SSE
extension) to `/playground/turns/{id}/stream`; that stream proxies the model server's stream and ends with
`end`. The conversation lives here, in memory and bounded, so the page sends only the new message; the
system prompt and sampling settings are the form's, per turn. A model server's refusal or absence is shown
in the reply bubble, never raised."""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated

import httpx
from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse
from markupsafe import escape
from sse_starlette.sse import EventSourceResponse

from tether.chat.completion import ChatRequest, ModelError
from tether.chat.messages import Messages
from tether.console.chat_stream import list_models, stream_reply
from tether.console.errors import ConsoleError, bad_input, not_configured, not_found
from tether.console.pages import render
from tether.console.state import Console

CONVERSATIONS_KEPT = 256


@dataclass(frozen=True, slots=True)
class ModelServer:
    url: str
    models: tuple[str, ...] = ()
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class PendingTurn:
    id: str
    base_url: str
    model: str
    request: ChatRequest


@dataclass
class Conversation:
    id: str
    messages: Messages = field(default_factory=list)
    pending: PendingTurn | None = None


class Conversations:
    """The playground's conversations, the least recently used forgotten beyond `keep`."""

    def __init__(self, keep: int = CONVERSATIONS_KEPT) -> None:
        self.keep = keep
        self._by_id: OrderedDict[str, Conversation] = OrderedDict()

    def get_or_start(self, conversation_id: str) -> Conversation:
        found = self._by_id.get(conversation_id) if conversation_id else None
        if found is None:
            if conversation_id:
                raise not_found(
                    "conversation", conversation_id, "it was forgotten; reload the page to start anew"
                )
            found = Conversation(secrets.token_hex(8))
            self._by_id[found.id] = found
        self._by_id.move_to_end(found.id)
        while len(self._by_id) > self.keep:
            self._by_id.popitem(last=False)
        return found

    def take_turn(self, conversation_id: str, turn_id: str) -> tuple[Conversation, PendingTurn]:
        """The turn to stream; each is streamed once."""
        found = self._by_id.get(conversation_id)
        if found is None or found.pending is None or found.pending.id != turn_id:
            raise not_found("turn", turn_id, "each reply streams once; send a new message")
        turn, found.pending = found.pending, None
        return found, turn


def router(console: Console) -> APIRouter:
    routes = APIRouter()
    client = httpx.AsyncClient()
    console.on_close(client.aclose)
    conversations = Conversations()
    key = console.config.model_api_key

    def urls() -> tuple[str, ...]:
        if not console.config.model_urls:
            raise not_configured("no model server", "--model-url URL (an OpenAI-compatible …/v1)")
        return console.config.model_urls

    async def server(url: str) -> ModelServer:
        try:
            return ModelServer(url, tuple(await list_models(client, url, key)))
        except ModelError as error:
            return ModelServer(url, problem=str(error))

    async def servers() -> list[ModelServer]:
        return list(await asyncio.gather(*(server(url) for url in urls())))

    @routes.get("/playground", response_class=HTMLResponse)
    async def playground_page(request: Request) -> HTMLResponse:
        found = await servers()
        return render(console.jinja, request, "playground.html", active="playground", servers=found)

    @routes.get("/api/playground/models")
    async def models_api() -> dict[str, object]:
        found = await servers()
        return {"servers": [{"url": s.url, "models": list(s.models), "problem": s.problem} for s in found]}

    @routes.post("/playground/turns", response_class=HTMLResponse)
    async def new_turn(
        request: Request,
        message: Annotated[str, Form(min_length=1, max_length=50_000)],
        target: Annotated[str, Form(alias="model", min_length=3, max_length=600)],
        system: Annotated[str, Form(max_length=20_000)] = "",
        temperature: Annotated[float, Form(ge=0.0, le=2.0)] = 0.7,
        max_tokens: Annotated[int, Form(ge=1, le=32_768)] = 256,
        conversation_id: Annotated[str, Form(alias="conversation", max_length=64)] = "",
    ) -> HTMLResponse:
        # `target` is "INDEX|MODEL": which of this console's servers, and a model it listed
        index, _, model = target.partition("|")
        if not index.isdigit() or not int(index) < len(urls()) or not model:
            raise bad_input(f"model {target!r}: pick one of the listed models", "model")
        if not message.strip():
            raise bad_input("message: say something", "message")
        conversation = conversations.get_or_start(conversation_id)
        if conversation.pending is not None:
            raise ConsoleError(409, "the last reply is still coming; wait for it", "reply_pending")
        conversation.messages.append({"role": "user", "content": message})
        prompt = ([{"role": "system", "content": system}] if system.strip() else []) + conversation.messages
        turn = PendingTurn(
            secrets.token_hex(8),
            urls()[int(index)],
            model,
            ChatRequest(messages=prompt, max_tokens=max_tokens, temperature=temperature),
        )
        conversation.pending = turn
        return render(
            console.jinja,
            request,
            "playground_turn.html",
            conversation=conversation,
            turn=turn,
            message=message,
        )

    @routes.get("/playground/turns/{conversation_id}/{turn_id}/stream")
    async def turn_stream(conversation_id: str, turn_id: str) -> EventSourceResponse:
        conversation, turn = conversations.take_turn(conversation_id, turn_id)

        async def events() -> AsyncIterator[dict[str, str]]:
            reply: list[str] = []
            failed = False
            try:
                async for text in stream_reply(client, turn.base_url, key, turn.model, turn.request):
                    reply.append(text)
                    yield {"event": "token", "data": str(escape(text))}
            except ModelError as error:
                failed = True
                yield {"event": "token", "data": f'<span class="chat-error">{escape(str(error))}</span>'}
            finally:
                if failed:  # the message was not answered: sending it again must not repeat it
                    conversation.messages.pop()
                else:  # what arrived is the reply, even if the page went away before the end
                    conversation.messages.append({"role": "assistant", "content": "".join(reply)})
            # swapped in like a token (the page knows the reply is whole), then the page closes the stream
            yield {"event": "end", "data": '<span class="chat-done"></span>'}

        return EventSourceResponse(events())

    return routes
