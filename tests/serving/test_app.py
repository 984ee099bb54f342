"""The OpenAI-compatible server on a tiny random Qwen3: response shapes, streaming, the official client over
a real socket, preemption under 100 concurrent streams, prefix-cache usage, errors, metrics, aborts."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz import (
    assert_client_error_or_success,
    deeply_nested,
    encode,
    json_values,
    mutated_bodies,
    surrogate_text,
)
from tests.serving.conftest import CHAT, MODEL, TEXT, aborted_count, chat, send_sync, sse_events, text
from tether.engine.async_engine import (
    AsyncEngine,
    AsyncEngineConfig,
    EngineStoppedError,
    _held_back,
)
from tether.engine.llm_engine import LLMEngine
from tether.engine.sampling import SamplingParams
from tether.models.governor import ThreadGovernor
from tether.serving.app import create_app


@pytest.mark.parametrize(
    ("text_so_far", "stops", "held"),
    [("abc", (), 0), ("ab\ufffd", (), 1), ("hello wor", ("world",), 3), ("hello", ("lo!", "o"), 2)],
)
def test_held_back_covers_unfinished_characters_and_stop_prefixes(
    text_so_far: str, stops: tuple[str, ...], held: int
) -> None:
    assert _held_back(text_so_far, stops) == held


async def test_chat_completion_has_openai_shape(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json=chat(logprobs=True, top_logprobs=0, n=2, seed=3))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    for choice in body["choices"]:
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("stop", "length")
        assert all(entry["logprob"] <= 0 for entry in choice["logprobs"]["content"])
    usage = body["usage"]
    generated = sum(len(choice["logprobs"]["content"]) for choice in body["choices"])
    assert usage["completion_tokens"] == generated > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + generated
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0


async def test_completion_honours_max_tokens_and_token_id_prompts(client: httpx.AsyncClient) -> None:
    response = await client.post(TEXT, json=text([5, 9, 13, 2], max_tokens=5, ignore_eos=True))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 5


async def test_greedy_stream_matches_the_whole_response(client: httpx.AsyncClient) -> None:
    fields = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    whole = (await client.post(TEXT, json=text("stream me", **fields))).json()
    streamed = await client.post(
        TEXT, json=text("stream me", stream=True, stream_options={"include_usage": True}, **fields)
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert all(event["object"] == "text_completion" for event in events)
    assert "".join(c["text"] for e in events for c in e["choices"]) == whole["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12


async def test_chat_stream_sends_role_then_content_then_finish(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json=chat(stream=True, temperature=0))
    events = sse_events(response.text)
    assert all(event["object"] == "chat.completion.chunk" for event in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("usage" not in event for event in events)


def test_official_client_over_a_real_socket(live_url: str) -> None:
    client = openai.OpenAI(base_url=f"{live_url}/v1", api_key="unused", max_retries=0)
    assert [model.id for model in client.models.list()] == [MODEL]
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert reply.choices[0].message.role == "assistant" and reply.usage is not None
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    )
    completion = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, stream=True)
    assert any(chunk.choices[0].finish_reason for chunk in completion)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-nope", prompt="abc", max_tokens=4)


def test_closing_a_stream_aborts_its_request(served: tuple[AsyncEngine, FastAPI], live_url: str) -> None:
    async_engine, app = served
    aborted = aborted_count(app)
    body = text("a long one", max_tokens=240, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{live_url}{TEXT}", json=body, timeout=30) as response:
        next(response.iter_lines())
    deadline = time.monotonic() + 10
    while async_engine.num_pending:
        assert time.monotonic() < deadline, "the abandoned request is still in the engine"
        time.sleep(0.01)
    assert aborted_count(app) == aborted + 1


async def test_shared_long_prefix_reports_cached_tokens(client: httpx.AsyncClient) -> None:
    prefix = "You are a careful assistant. " * 4
    first = await client.post(TEXT, json=text(prefix + "First question?", max_tokens=2))
    second = await client.post(TEXT, json=text(prefix + "Second one?", max_tokens=2))
    assert first.status_code == second.status_code == 200
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 64, cached  # the 100-plus shared bytes span several 16-token blocks


async def test_hundred_streams_survive_preemption(tiny_path: Path) -> None:
    # 1 MiB holds 64 blocks of 16 tokens; 64 seats of ~40 tokens each need more: the scheduler preempts.
    engine, tokenizer = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=1, max_model_len=128)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    app = create_app(async_engine, tokenizer, MODEL)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://tether", timeout=120) as client:

            async def one(i: int) -> list[Any]:
                prompt = f"request number {i}: tell me something"
                body = text(prompt, max_tokens=16, ignore_eos=True, stream=True, seed=i)
                response = await client.post(TEXT, json={**body, "stream_options": {"include_usage": True}})
                assert response.status_code == 200, response.text
                return sse_events(response.text)

            results = await asyncio.gather(*(one(i) for i in range(100)))
            metrics = (await client.get("/metrics")).text
    finally:
        async_engine.shutdown()
    assert engine.scheduler.num_preemptions > 0
    for events in results:
        assert events[-1]["usage"]["completion_tokens"] == 16
        assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert not engine.has_unfinished() and async_engine.num_pending == 0
    assert f"tether_preemptions_total {float(engine.scheduler.num_preemptions)}" in metrics


async def test_full_queue_is_refused_with_503(tiny_path: Path) -> None:
    engine, tokenizer = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=1, max_model_len=256)
    async_engine = AsyncEngine(engine, AsyncEngineConfig(max_pending_requests=1))
    async_engine.start()
    app = create_app(async_engine, tokenizer, MODEL)
    try:
        stream = async_engine.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        await anext(stream)  # holds the only place
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            response = await client.post(TEXT, json=text())
        await stream.aclose()
    finally:
        async_engine.shutdown()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_overloaded"


BAD_REQUESTS: list[tuple[str, str, Any, int, str | None]] = [
    ("unknown-model", TEXT, {**text(), "model": "gpt-4"}, 404, "model"),
    ("zero-max-tokens", TEXT, text(max_tokens=0), 400, "max_tokens"),
    ("negative-max-tokens", CHAT, chat(max_tokens=-3), 400, "max_tokens"),
    (
        "zero-max-completion-tokens",
        CHAT,
        chat(max_tokens=None, max_completion_tokens=0),
        400,
        "max_completion_tokens",
    ),
    ("prompt-too-long", TEXT, text("x" * 300), 400, "prompt"),
    ("prompt-plus-max-tokens-too-long", TEXT, text("x" * 200, max_tokens=100), 400, "prompt"),
    ("empty-prompt", TEXT, text(""), 400, "prompt"),
    ("token-id-out-of-range", TEXT, text([1, 10**6]), 400, "prompt"),
    ("negative-temperature", CHAT, chat(temperature=-1), 400, "temperature"),
    ("temperature-not-a-number", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("zero-top-p", TEXT, text(top_p=0), 400, "top_p"),
    ("zero-top-k", TEXT, text(top_k=0), 400, "top_k"),
    ("min-p-one", TEXT, text(min_p=1), 400, "min_p"),
    ("zero-n", CHAT, chat(n=0), 400, "n"),
    ("empty-stop", CHAT, chat(stop=[""]), 400, "stop"),
    ("top-logprobs-over-20", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top-logprobs-negative", CHAT, chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("completion-logprobs-over-20", TEXT, text(logprobs=21), 400, "logprobs"),
    ("both-max-tokens", CHAT, chat(max_completion_tokens=4), 400, "max_completion_tokens"),
    ("no-messages", CHAT, {**chat(), "messages": []}, 400, "messages"),
    ("bad-role", CHAT, {**chat(), "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("missing-model", TEXT, {"prompt": "x"}, 400, "model"),
    ("unknown-field", TEXT, text(frobnicate=1), 400, "frobnicate"),
    ("malformed-json", TEXT, b'{"model": ', 400, None),
    ("not-an-object", TEXT, b"[1, 2]", 400, None),
    ("surrogate-in-prompt", TEXT, text("a\ud800b"), 400, "prompt"),
    ("surrogate-in-prompt-start", TEXT, text("\udfff"), 400, "prompt"),
    ("surrogate-in-message", CHAT, chat("hi \udc00"), 400, "messages.0.content"),
    ("surrogate-in-stop", TEXT, text(stop=["ok", "\ud83d"]), 400, "stop"),
    ("surrogate-in-model", TEXT, {**text(), "model": "\ud800"}, 400, "model"),
    ("surrogate-in-unknown-field", TEXT, {**text(), "\ud800": 1}, 400, None),
    ("not-utf-8", TEXT, b'{"model": "\xff"}', 400, None),
    ("nested-100000-deep", TEXT, deeply_nested(), 400, None),
    ("nested-100000-deep-chat", CHAT, deeply_nested(), 400, None),
    ("prompt-nested-500-deep", TEXT, b'{"model": "m", "prompt": ' + deeply_nested(500) + b"}", 400, "prompt"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
async def test_bad_request_gets_openai_error(
    client: httpx.AsyncClient, path: str, body: Any, status: int, param: str | None
) -> None:
    if not isinstance(body, bytes):
        body = encode(body)
    response = await client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
        assert param in error["message"] or status == 404


UNSUPPORTED_FIELDS = [
    (CHAT, "functions", [{"name": "f", "parameters": {}}]),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (TEXT, "frequency_penalty", 0.5),
    (CHAT, "presence_penalty", 0.5),
    (TEXT, "logit_bias", {"50256": -100}),
]


@pytest.mark.parametrize(
    ("path", "field", "value"), UNSUPPORTED_FIELDS, ids=[f[1] for f in UNSUPPORTED_FIELDS]
)
async def test_unsupported_field_is_named_with_the_supported_ones(
    client: httpx.AsyncClient, path: str, field: str, value: Any
) -> None:
    body = (chat if path == CHAT else text)(**{field: value})
    response = await client.post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert f"{field}: not supported by this server" in error["message"]
    assert "Extra inputs" not in error["message"]
    supported = error["message"].split("Supported fields: ")[1].split(", ")
    assert {"model", "max_tokens", "temperature", "stop", "stream"} <= set(supported)
    assert ("messages" in supported) == (path == CHAT) and ("prompt" in supported) == (path == TEXT)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("POST", "/v1/embeddings", 404), ("GET", "/v1/models/tiny-qwen3", 404), ("GET", TEXT, 405)],
)
async def test_unknown_endpoint_gets_json_error_listing_the_supported_ones(
    client: httpx.AsyncClient, method: str, path: str, status: int
) -> None:
    response = await client.request(method, path, json={"model": MODEL, "input": "x"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "unsupported_endpoint"
    assert f"{method} {path} is not supported by this server" in error["message"]
    for endpoint in (f"POST {CHAT}", f"POST {TEXT}", "GET /v1/models", "GET /healthz", "GET /metrics"):
        assert endpoint in error["message"]


# Short generations: the property is about refusals, and a mutated body may drop max_tokens.
FUZZ_EXAMPLES = {
    CHAT: {**chat(), "max_tokens": 2, "stop": ["x"], "temperature": 0.5, "n": 1, "stream": False},
    TEXT: {**text(), "max_tokens": 2, "stop": "x", "seed": 1, "top_k": 5, "stream": False},
}


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_fuzzed_bodies_get_a_client_error_or_a_completion(
    served: tuple[AsyncEngine, FastAPI], path: str
) -> None:
    app = served[1]

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(body=mutated_bodies(FUZZ_EXAMPLES[path]), max_tokens=st.integers(1, 3))
    def property(body: dict[str, Any], max_tokens: int) -> None:
        if body.get("max_tokens") is None or body.get("n") not in (None, 1):
            body = {**body, "max_tokens": max_tokens}  # keep every accepted request to a few tokens
        response = send_sync(app, path, encode(body))
        assert_client_error_or_success(response.status_code, response.content, route=path)

    property()


def test_any_method_and_body_on_any_route_gets_a_client_error_or_a_success(
    served: tuple[AsyncEngine, FastAPI],
) -> None:
    app = served[1]
    paths = [CHAT, TEXT, "/v1/models", "/healthz", "/metrics", "/v1/embeddings", "/v1/models/x", "/"]

    @settings(max_examples=100, deadline=None)
    @given(
        method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
        path=st.sampled_from(paths),
        body=json_values,
    )
    def property(method: str, path: str, body: Any) -> None:
        response = send_sync(app, path, encode(body), method)
        assert_client_error_or_success(response.status_code, response.content, route=f"{method} {path}")

    property()


# Where a client's text goes, per route: the field, and how a string is placed there.
TEXT_FIELDS: dict[str, list[tuple[str, Any]]] = {
    CHAT: [
        ("model", lambda s: {"model": s}),
        ("messages.0.content", lambda s: {"messages": [{"role": "user", "content": s}]}),
        (
            "messages.0.content.0.text",
            lambda s: {"messages": [{"role": "user", "content": [{"type": "text", "text": s}]}]},
        ),
        ("messages.0.name", lambda s: {"messages": [{"role": "user", "content": "hi", "name": s}]}),
        ("stop", lambda s: {"stop": [s]}),
        ("user", lambda s: {"user": s}),
    ],
    TEXT: [
        ("model", lambda s: {"model": s}),
        ("prompt", lambda s: {"prompt": s}),
        ("stop", lambda s: {"stop": s}),
        ("user", lambda s: {"user": s}),
    ],
}


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_lone_surrogate_in_any_text_field_is_refused_naming_the_field(
    served: tuple[AsyncEngine, FastAPI], path: str
) -> None:
    app = served[1]

    @settings(max_examples=60, deadline=None)
    @given(place=st.sampled_from(TEXT_FIELDS[path]), value=surrogate_text)
    def property(place: tuple[str, Any], value: str) -> None:
        field, fields = place
        response = send_sync(app, path, encode({**FUZZ_EXAMPLES[path], **fields(value)}))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and "lone UTF-16 surrogate" in error["message"], error

    property()


async def test_metrics_health_and_models(client: httpx.AsyncClient) -> None:
    await client.post(TEXT, json=text(max_tokens=3))
    metrics = (await client.get("/metrics")).text
    for name in (
        "tether_queue_depth",
        "tether_running_sequences",
        "tether_torch_threads",
        "tether_thread_changes_total",
        "tether_kv_blocks_used",
        "tether_prefix_cache_hit_rate",
        "tether_generated_tokens_total",
        "tether_time_to_first_token_seconds_bucket",
        "tether_time_per_output_token_seconds_bucket",
        'tether_requests_total{status="completed"}',
    ):
        assert name in metrics, name
    health = await client.get("/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL


async def test_client_leaving_a_whole_response_aborts_its_request(
    served: tuple[AsyncEngine, FastAPI],
) -> None:
    async_engine, app = served
    payload = json.dumps(text("leave early", max_tokens=240, ignore_eos=True)).encode()
    messages = [{"type": "http.request", "body": payload, "more_body": False}, {"type": "http.disconnect"}]
    sent: list[Any] = []

    async def receive() -> Any:
        return messages.pop(0) if messages else await asyncio.Future()

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "path": TEXT,
        "raw_path": TEXT.encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("tether", 80),
        "scheme": "http",
        "root_path": "",
    }
    aborted = aborted_count(app)
    await app(scope, receive, send)
    assert sent[0]["status"] == 499
    deadline = time.monotonic() + 10
    while async_engine.num_pending:
        assert time.monotonic() < deadline, "the abandoned request is still in the engine"
        await asyncio.sleep(0.01)
    assert aborted_count(app) == aborted + 1


async def test_stopped_engine_reports_unhealthy_and_refuses_requests(tiny_path: Path) -> None:
    engine, tokenizer = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=1, max_model_len=128)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    async_engine.shutdown()
    app = create_app(async_engine, tokenizer, MODEL)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        assert (await client.get("/healthz")).status_code == 503
        response = await client.post(TEXT, json=text())
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_stopped"


async def test_metrics_report_weight_updates(tiny_path: Path) -> None:
    engine, tokenizer = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=1, max_model_len=128)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        app = create_app(async_engine, tokenizer, MODEL)
        weights = {name: param.detach().clone() for name, param in engine.named_parameters()}
        assert await async_engine.update_weights(weights, version=3) == 3
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            metrics = (await client.get("/metrics")).text
    finally:
        async_engine.shutdown()
    assert "tether_policy_version 3.0" in metrics
    assert "tether_weight_updates_total 1.0" in metrics
    assert "tether_prefix_cache_invalidations_total 1.0" in metrics
    assert "tether_pending_weight_updates 0.0" in metrics


async def test_stop_string_cuts_whole_and_streamed_text_alike(client: httpx.AsyncClient) -> None:
    fields = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    full = (await client.post(TEXT, json=text("stop here", **fields))).json()["choices"][0]["text"]
    start = next(
        i
        for i in range(4, len(full) - 2)
        if full[i : i + 2].isprintable() and "\ufffd" not in full[i : i + 2]
    )
    stop = full[start : start + 2]
    whole = (await client.post(TEXT, json=text("stop here", stop=stop, **fields))).json()["choices"][0]
    assert whole["text"] == full[: full.find(stop)] and whole["finish_reason"] == "stop"
    events = sse_events(
        (await client.post(TEXT, json=text("stop here", stop=[stop], stream=True, **fields))).text
    )
    assert "".join(c["text"] for e in events for c in e["choices"]) == whole["text"]


async def test_shutdown_drains_running_requests_then_refuses_new_ones(tiny_path: Path) -> None:
    engine, _ = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=1, max_model_len=128)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    stream = async_engine.generate([5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True))
    tokens = len((await anext(stream)).completions[0].token_ids)
    closing = asyncio.ensure_future(asyncio.to_thread(async_engine.shutdown, 30.0))
    async for delta in stream:
        tokens += sum(len(completion.token_ids) for completion in delta.completions)
    await closing
    assert tokens == 60
    with pytest.raises(EngineStoppedError):
        await anext(async_engine.generate([5], SamplingParams()))


async def test_shutdown_without_drain_fails_unfinished_requests(tiny_path: Path) -> None:
    engine, _ = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=1, max_model_len=256)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    stream = async_engine.generate([5, 6, 7], SamplingParams(max_tokens=250, ignore_eos=True))
    await anext(stream)
    async_engine.shutdown()
    with pytest.raises(EngineStoppedError):
        async for _ in stream:
            pass
    assert async_engine.num_pending == 0


def test_adapt_threads_gives_the_runner_a_governor(tiny_path: Path) -> None:
    adaptive, _ = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=1, max_model_len=128, adapt_threads=True)
    fixed, _ = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=1, max_model_len=128)
    assert isinstance(adaptive.runner.governor, ThreadGovernor)
    assert fixed.runner.governor is None


async def test_top_logprobs_list_the_most_likely_tokens_first(client: httpx.AsyncClient) -> None:
    fields: dict[str, Any] = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "logprobs": True}
    fields["top_logprobs"] = 3
    whole = (await client.post(CHAT, json=chat(**fields))).json()["choices"][0]["logprobs"]["content"]
    assert len(whole) == 6
    for entry in whole:
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and [t["logprob"] for t in tops] == sorted(
            (t["logprob"] for t in tops), reverse=True
        )
        assert (tops[0]["token"], tops[0]["logprob"]) == (entry["token"], pytest.approx(entry["logprob"]))
        assert all(t["bytes"] == list(t["token"].encode()) for t in tops)
    events = sse_events((await client.post(CHAT, json=chat(stream=True, **fields))).text)
    streamed = [
        entry for e in events for c in e["choices"] if c["logprobs"] for entry in c["logprobs"]["content"]
    ]
    assert streamed == whole
    legacy = (await client.post(TEXT, json=text(logprobs=2, temperature=0, max_tokens=4))).json()
    assert all(1 <= len(top) <= 2 for top in legacy["choices"][0]["logprobs"]["top_logprobs"])


@pytest.mark.parametrize("path", [CHAT, TEXT])
async def test_each_streamed_sample_finishes_once(client: httpx.AsyncClient, path: str) -> None:
    # Stop strings end the samples at different steps; the engine repeats a finished sample's last state
    # while the others go on, which must not repeat its finish.
    fields: dict[str, Any] = {
        "n": 4,
        "stop": ["e", "a"],
        "temperature": 1.0,
        "seed": 3,
        "max_tokens": 40,
        "stream": True,
    }
    body = chat(**fields) if path == CHAT else text(**fields)
    events = sse_events((await client.post(path, json=body)).text)
    finishes = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2, 3]
