"""`--model NAME`: tether's own engine in this process, reached through its OpenAI-compatible app.

The engine's FastAPI app is called in-process over httpx's ASGI transport, so the agent talks to it
exactly as it would to `tether serve` on the network; no port is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tether.agents.model import OpenAIChatModel


class EngineModel(OpenAIChatModel):
    def __init__(
        self,
        name: str,
        cache_dir: Path,
        kv_cache_mib: int = 256,
        device: str = "auto",
        dtype: str = "float32",
    ) -> None:
        """`device` and `dtype` as `tether.models.precision` spells them, checked before anything loads."""
        from tether.engine.async_engine import AsyncEngine, AsyncEngineConfig
        from tether.engine.llm_engine import LLMEngine
        from tether.models import configure_threads
        from tether.models.loader import resolve
        from tether.models.precision import DType, resolve_device
        from tether.serving.app import create_app

        where, kind = resolve_device(device, "--device"), DType.parse(dtype, "--dtype")
        on_cpu = where.type == "cpu"
        if on_cpu:  # CPU threads matter only where the model computes on them
            configure_threads()
        folder = resolve(name, cache_dir)  # a folder, a registered name, or a trained run's checkpoint
        engine, tokenizer = LLMEngine.from_pretrained(
            folder, kv_cache_mib=kv_cache_mib, device=where, dtype=kind.torch, adapt_threads=on_cpu
        )
        self._engine: Any = AsyncEngine(engine, AsyncEngineConfig())
        app = create_app(self._engine, tokenizer, name)
        self._engine.start()
        super().__init__("http://engine.local/v1", name, transport=httpx.ASGITransport(app=app))

    async def close(self) -> None:
        await super().close()
        self._engine.shutdown()
