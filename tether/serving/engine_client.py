"""`EngineClient`: tether's engine in this process, reached through its OpenAI-compatible app, and
`open_client`, which turns a `--model`/`--base-url` pair into the `ChatClient` it names.

The app is called over httpx's ASGI transport, so a caller talks to the in-process engine exactly as it
would to `tether serve` on the network (the same tool-call format, constraints and refusals); no port is
opened. It counts a request's prompt tokens as the server will (`tether.chat.tokens.PromptCounter`), so
an agent can keep its context within a token budget before it sends it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tether.chat import ChatClient, ChatRequest
from tether.chat.completion import ModelError
from tether.chat.openai_client import OpenAIClient, request_body
from tether.errors import ConfigError
from tether.serving.jobs import JobFactory
from tether.serving.openai_api import APIError, ChatCompletionRequest
from tether.testing.scripted import ScriptedClient


class EngineClient(OpenAIClient):
    def __init__(
        self,
        name: str,
        cache_dir: Path | None,
        kv_cache_mib: int = 256,
        device: str = "auto",
        dtype: str = "float32",
        max_model_len: int | None = None,
        rope_scaling: str | None = None,
    ) -> None:
        """`device` and `dtype` as `tether.models.precision` spells them and `rope_scaling` as
        `RopeScaling.parse` reads it, checked before anything loads; `max_model_len` as
        `LLMEngine.from_pretrained` takes it."""
        from tether.engine.async_engine import AsyncEngine, AsyncEngineConfig
        from tether.engine.llm_engine import LLMEngine
        from tether.models import configure_threads
        from tether.models.config import RopeScaling
        from tether.models.loader import resolve
        from tether.models.omp_pools import in_passing_thread
        from tether.models.precision import DType, resolve_device
        from tether.serving.app import create_app

        where, kind = resolve_device(device, "--device"), DType.parse(dtype, "--dtype")
        rope = None if rope_scaling is None else RopeScaling.parse(rope_scaling)
        on_cpu = where.type == "cpu"
        if on_cpu:  # CPU threads matter only where the model computes on them
            configure_threads()
        folder = resolve(name, cache_dir)  # a registered name, a model folder or a run's checkpoint
        # Loaded in a passing thread, as `tether serve` loads: the engine computes in its own thread,
        # whose OpenMP pool should be the process's only one (`models.omp_pools`).
        engine, tokenizer = in_passing_thread(
            lambda: LLMEngine.from_pretrained(
                folder,
                kv_cache_mib=kv_cache_mib,
                device=where,
                dtype=kind.torch,
                adapt_threads=on_cpu,
                max_model_len=max_model_len,
                rope_scaling=rope,
            )
        )
        self._engine: Any = AsyncEngine(engine, AsyncEngineConfig())
        self._max_model_len = int(engine.config.max_model_len)
        # The app's own factory is behind the app; an identical one here renders prompts the same way.
        self._jobs = JobFactory(tokenizer, name, min(len(tokenizer), engine.vocab_size), self._max_model_len)
        app = create_app(self._engine, tokenizer, name)
        self._engine.start()
        super().__init__("http://engine.local/v1", name, transport=httpx.ASGITransport(app=app))

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def count_prompt_tokens(self, request: ChatRequest) -> int:
        """The tokens the served chat template makes of `request`: the server's `prompt_tokens`."""
        try:
            body = ChatCompletionRequest.model_validate(request_body(self.name, request))
            return len(self._jobs.chat_prompt(body)[2])
        except APIError as error:
            raise ModelError(f"cannot count the prompt: {error}") from None

    async def close(self) -> None:
        await super().close()
        self._engine.shutdown()


def open_client(
    model: str | None,
    base_url: str | None,
    cache_dir: Path | None,
    device: str = "auto",
    dtype: str = "float32",
    api_key: str | None = None,
    kv_cache_mib: int = 256,
    max_model_len: int | None = None,
    rope_scaling: str | None = None,
) -> ChatClient:
    """`scripted:FILE`, a server at `base_url` (`model` names what to ask it for), or an engine in process
    on `device` in `dtype` (`tether.models.precision`) with `kv_cache_mib` of KV cache, sequences of up
    to `max_model_len` and `rope_scaling` (`EngineClient`; the other two ignore those)."""
    if model and model.startswith("scripted:"):
        if base_url:
            raise ConfigError("--model scripted:FILE replays a file; do not also give --base-url")
        return ScriptedClient.from_file(Path(model[len("scripted:") :]))
    if base_url:
        return OpenAIClient(base_url, model or "default", api_key=api_key)
    if not model:
        raise ConfigError("no model: give --model NAME, --model scripted:FILE or --base-url URL")
    return EngineClient(
        model,
        cache_dir,
        kv_cache_mib=kv_cache_mib,
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        rope_scaling=rope_scaling,
    )
