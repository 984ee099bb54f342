"""The priority measurement shared by the fast (tiny model) and slow (SmolLM2) tests: saturate the engine
with standard-tier streams, then time the first token of fast- and standard-tier streams sent together."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx

from tether.gateway import Gateway, Limits, Tier


async def first_token_s(http: httpx.AsyncClient, secret: str, model: str, max_tokens: int) -> float:
    started = time.monotonic()
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me about gateways."}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {secret}"}
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        first = None
        async for line in response.aiter_lines():
            if first is None and '"content":"' in line and '"content":""' not in line:
                first = time.monotonic() - started
        assert first is not None
        return first


async def ttft_medians(
    url: str, gateway: Gateway, model: str, background: int, probes: int, background_tokens: int
) -> tuple[float, float]:
    """Medians of (fast, standard) TTFT: `background` standard streams keep the engine full the whole
    time while a fast and a standard probe are sent together every 0.2 s."""
    standard, _ = gateway.keys.create("bulk", Tier.STANDARD, Limits())
    fast, _ = gateway.keys.create("vip", Tier.FAST, Limits())
    stop = asyncio.Event()

    async def keep_busy(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            await first_token_s(http, standard, model, background_tokens)

    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=200)) as http:
        load = [asyncio.create_task(keep_busy(http)) for _ in range(background)]
        await asyncio.sleep(0.5)  # the engine is now full of standard work
        pairs = []
        for _ in range(probes):
            pairs.append(
                asyncio.gather(first_token_s(http, fast, model, 4), first_token_s(http, standard, model, 4))
            )
            await asyncio.sleep(0.2)
        results = await asyncio.gather(*pairs)
        stop.set()
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)
    return statistics.median(f for f, _ in results), statistics.median(s for _, s in results)
