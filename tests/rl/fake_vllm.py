"""A fake vLLM server for the remote rollout back end: token ids in, token ids and logprobs out, weight
updates through vLLM's pause / start / update / finish / resume endpoints, `/health`, and injected
failures. Run as a module (`python -m tests.rl.fake_vllm PORT DELAY_S`) it is a process a test can kill
by pid.

Its "model" is arithmetic: token i of sample j is a function of the prompt, i and j, and every logprob
encodes the weight version it was generated with (`logprob_of(version)`). A completion sleeps halfway
through, so an update that slipped in while it ran would show as two versions in one completion.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from safetensors import safe_open


def logprob_of(version: int) -> float:
    return -0.125 * (version + 1)


def token_of(prompt: list[int], index: int, sample: int) -> int:
    return (sum(prompt) * 31 + 13 * index + 17 * sample) % 97 + 3


@dataclass(slots=True)
class FakeState:
    version: int = 0
    paused: bool = False
    in_flight: int = 0
    overlaps: int = 0
    """Updates that started while a completion was running: the client's gate must make this 0."""
    delay_s: float = 0.0
    fail: dict[str, int] = field(default_factory=dict)
    """Endpoint -> HTTP status to answer once instead of working."""
    broken: dict[str, int] = field(default_factory=dict)
    """Endpoint -> HTTP status to answer every time (`/health` included)."""
    malformed: bool = False
    """Answer completions without the 'token_id:' spelling, as a server ignoring the flag would."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)
    """The Authorization header of each completion request."""
    updates: list[dict[str, Any]] = field(default_factory=list)
    cache_resets: int = 0
    cached_tokens: int | None = None
    """Cached prompt tokens to report in usage.prompt_tokens_details (None: no details, vLLM's default)."""


def _error(status: int, message: str) -> JSONResponse:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return JSONResponse(
        {"object": "error", "message": message, "type": kind, "code": status}, status_code=status
    )


def create_fake_vllm(state: FakeState) -> FastAPI:
    app = FastAPI()

    def injected(endpoint: str) -> JSONResponse | None:
        status = state.fail.pop(endpoint, None) or state.broken.get(endpoint)
        return None if status is None else _error(status, f"injected failure of {endpoint}")

    @app.get("/health")
    async def health() -> Any:
        return injected("/health") or PlainTextResponse("")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        if (failure := injected("/v1/completions")) is not None:
            return failure
        body = await request.json()
        state.requests.append(body)
        state.authorizations.append(request.headers.get("authorization"))
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            return _error(400, f"prompt must be a list of token ids, got {prompt!r}")
        if body.get("logprobs") is None or body.get("return_tokens_as_token_ids") is not True:
            return _error(400, "this fake needs logprobs and return_tokens_as_token_ids")
        max_tokens, n = int(body["max_tokens"]), int(body.get("n", 1))
        state.in_flight += 1
        try:
            first = state.version
            await asyncio.sleep(state.delay_s)
            second = state.version
        finally:
            state.in_flight -= 1
        choices = []
        for sample in range(n):
            ids = [token_of(prompt, i, sample) for i in range(max_tokens)]
            versions = [first if i < max_tokens // 2 else second for i in range(max_tokens)]
            tokens = [str(t) if state.malformed else f"token_id:{t}" for t in ids]
            choices.append(
                {
                    "index": sample,
                    "text": "".join(chr(96 + t % 26) for t in ids),
                    "logprobs": {
                        "text_offset": list(range(max_tokens)),
                        "token_logprobs": [logprob_of(v) for v in versions],
                        "tokens": tokens,
                        "top_logprobs": [None] * max_tokens,
                    },
                    "finish_reason": "length",
                    "stop_reason": None,
                    "token_ids": ids,
                }
            )
        return {
            "id": f"cmpl-{len(state.requests)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": n * max_tokens,
                **(
                    {"prompt_tokens_details": {"cached_tokens": state.cached_tokens}}
                    if state.cached_tokens is not None
                    else {}
                ),
            },
        }

    @app.post("/pause")
    async def pause(mode: str = "abort") -> Any:
        if (failure := injected("/pause")) is not None:
            return failure
        state.overlaps += state.in_flight > 0
        state.paused = True
        return PlainTextResponse("")

    @app.post("/start_weight_update")
    async def start(request: Request) -> Any:
        return injected("/start_weight_update") or {}

    @app.post("/update_weights")
    async def update(request: Request) -> Any:
        if (failure := injected("/update_weights")) is not None:
            return failure
        info = (await request.json())["update_info"]
        with safe_open(str(Path(info["location"]) / "model.safetensors"), "numpy") as stored:
            found = {name: list(stored.get_slice(name).get_shape()) for name in stored.keys()}  # noqa: SIM118
        if found != dict(zip(info["names"], info["shapes"], strict=True)):
            return _error(400, f"update_info {info['names']} does not match the stored tensors {found}")
        state.updates.append(info)
        return {}

    @app.post("/finish_weight_update")
    async def finish() -> Any:
        if (failure := injected("/finish_weight_update")) is not None:
            return failure
        state.version += 1
        return {}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Any:
        state.cache_resets += 1
        return PlainTextResponse("")

    @app.post("/resume")
    async def resume() -> Any:
        state.paused = False
        return PlainTextResponse("")

    return app


if __name__ == "__main__":
    import uvicorn

    port, delay_s = int(sys.argv[1]), float(sys.argv[2])
    uvicorn.run(
        create_fake_vllm(FakeState(delay_s=delay_s)), host="127.0.0.1", port=port, log_level="warning"
    )
