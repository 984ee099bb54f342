"""What the gateway will do with one request, decided from its body alone: the model and pool, the body
sent upstream (the engine's model name, tier priority, bounded `max_tokens`, usage always streamed) and
the tokens and spend to reserve. Pure: no I/O, every bad field a `GatewayError` naming it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tether.chat.pricing import Tier, to_nano_usd, worst_case_usd
from tether.errors import lone_surrogate
from tether.gateway.config import GatewayConfig
from tether.gateway.errors import GatewayError

Kind = Literal["chat", "text"]


@dataclass(frozen=True, slots=True)
class RequestPlan:
    kind: Kind
    model: str
    tier: Tier
    pool: str
    stream: bool
    client_wants_usage: bool
    upstream_body: bytes
    prompt_tokens_bound: int
    output_tokens_bound: int
    """`max_tokens` x `n`."""
    spend_bound_nano_usd: int
    n: int

    @property
    def tokens_bound(self) -> int:
        return self.prompt_tokens_bound + self.output_tokens_bound


def _bad(message: str, param: str | None) -> GatewayError:
    return GatewayError(400, message, "invalid_request", param=param)


def _too_deep() -> GatewayError:
    return GatewayError(
        400, "the body nests arrays or objects too deeply (a few hundred levels at most)", "invalid_json"
    )


def parse_body(raw: bytes) -> Any:
    """The request's JSON, or a 400 saying why it is not usable JSON."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as error:
        raise GatewayError(400, f"the body is not valid JSON: {error}", "invalid_json") from None


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad(f"{name} = {value!r}: expected an integer >= 1", name)
    return value


def _utf8_bytes(text: str, param: str) -> int:
    where = lone_surrogate(text)
    if where is not None:
        raise _bad(f"{param}: the text holds {where}", param)
    return len(text.encode())


def _text_bytes(content: Any) -> int:
    """UTF-8 bytes of a message's content: a string, or a list of `{"type": "text", "text": ...}` parts."""
    if content is None:
        return 0
    if isinstance(content, str):
        return _utf8_bytes(content, "messages")
    if isinstance(content, list):
        return sum(_text_bytes(part.get("text")) if isinstance(part, dict) else 0 for part in content)
    raise _bad(f"messages: content {content!r} must be a string or a list of text parts", "messages")


def _prompt_bound(kind: Kind, body: dict[str, Any], config: GatewayConfig) -> int:
    estimate = config.estimate
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad(f"messages = {messages!r}: expected a non-empty list of messages", "messages")
        if not all(isinstance(message, dict) for message in messages):
            raise _bad("messages: every message must be an object", "messages")
        text = sum(_text_bytes(m.get("content")) + _text_bytes(m.get("name")) for m in messages)
        return estimate.per_request_tokens + estimate.per_message_tokens * len(messages) + text
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return estimate.per_request_tokens + _utf8_bytes(prompt, "prompt")
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
    ):
        return len(prompt)  # token ids: exact
    raise _bad(f"prompt = {prompt!r}: expected a non-empty string or list of token ids", "prompt")


def plan_request(kind: Kind, body: Any, tier: Tier, config: GatewayConfig) -> RequestPlan:
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object", None)
    model = body.get("model")
    if not isinstance(model, str) or model not in config.models:
        raise GatewayError(
            404,
            f"The model `{model}` does not exist; this gateway serves {sorted(config.models)}.",
            "model_not_found",
            param="model",
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad(f"stream = {stream!r}: expected true or false", "stream")
    n = _positive_int(body, "n") or 1
    name = (
        "max_completion_tokens"
        if kind == "chat" and body.get("max_completion_tokens") is not None
        else "max_tokens"
    )
    max_tokens = _positive_int(body, name)
    upstream = dict(body, model=config.upstream_model(model))
    if max_tokens is None:  # bound the output so the reservation bounds the usage
        max_tokens = config.estimate.default_max_tokens
        upstream["max_tokens"] = max_tokens
    client_wants_usage = False
    if stream:
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise _bad(f"stream_options = {options!r}: expected an object", "stream_options")
        client_wants_usage = options.get("include_usage") is True
        upstream["stream_options"] = {**options, "include_usage": True}  # the ledger needs the usage
    pool = config.pool_for(model, tier)
    if config.pools[pool].send_priority:
        upstream["priority"] = config.tier_priority[tier]  # the tier decides, never the client
    else:
        upstream.pop("priority", None)
    prompt_bound = _prompt_bound(kind, body, config)
    output_bound = max_tokens * n
    spend = to_nano_usd(worst_case_usd(prompt_bound, output_bound, config.price(model, tier)))
    try:
        upstream_body = json.dumps(upstream, separators=(",", ":")).encode()
    except RecursionError:
        raise _too_deep() from None
    return RequestPlan(
        kind,
        model,
        tier,
        pool,
        stream,
        client_wants_usage,
        upstream_body,
        prompt_bound,
        output_bound,
        spend,
        n,
    )
