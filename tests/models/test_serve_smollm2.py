"""`tether serve` on the real SmolLM2 with a KV cache far too small for its load: 100 concurrent streaming
chat requests through the official client all complete, because the scheduler preempts and recomputes."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.live_server import served_process

pytestmark = pytest.mark.slow

REQUESTS = 100
MAX_TOKENS = 8


@pytest.fixture
def server(smollm2_folder: Path) -> Iterator[str]:
    # 8 MiB hold 11 blocks of 16 tokens (46 KiB of K/V per token): about four of these requests at once.
    with served_process(str(smollm2_folder), "--kv-cache-mib", "8") as url:
        yield url


async def one_stream(client: openai.AsyncOpenAI, model: str, i: int) -> tuple[str, str | None, int]:
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Request {i}: name an animal that starts with a vowel."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, completion_tokens = "", None, 0
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
    return text, finish, completion_tokens


def test_hundred_concurrent_streams_complete_under_preemption(server: str, smollm2_folder: Path) -> None:
    async def main() -> list[tuple[str, str | None, int]]:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", timeout=600, max_retries=0)
        async with client:
            return await asyncio.gather(
                *(one_stream(client, smollm2_folder.name, i) for i in range(REQUESTS))
            )

    results = asyncio.run(main())
    assert len(results) == REQUESTS
    for text, finish, completion_tokens in results:
        assert finish in ("stop", "length"), finish
        assert 1 <= completion_tokens <= MAX_TOKENS
        assert text
    metrics = httpx.get(f"{server}/metrics", timeout=10).text
    preemptions = re.search(r"^tether_preemptions_total (\S+)$", metrics, re.MULTILINE)
    assert preemptions is not None and float(preemptions.group(1)) > 0, "the cache was meant to overflow"
    completed = re.search(r'^tether_requests_total\{status="completed"\} (\S+)$', metrics, re.MULTILINE)
    assert completed is not None and float(completed.group(1)) == REQUESTS
    for status in ("aborted", "failed", "overloaded", "rejected"):
        assert f'tether_requests_total{{status="{status}"}} 0.0' in metrics
