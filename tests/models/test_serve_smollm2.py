"""`tether serve` on the real SmolLM2 with a KV cache far too small for its load: 100 concurrent streaming
chat requests through the official client all complete, because the scheduler preempts and recomputes."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

REQUESTS = 100
MAX_TOKENS = 8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def server(smollm2_folder: Path) -> Iterator[str]:
    port = free_port()
    # 8 MiB hold 11 blocks of 16 tokens (46 KiB of K/V per token): about four of these requests at once.
    command = [str(Path(sys.executable).parent / "tether"), "serve", "--model", str(smollm2_folder)]
    command += ["--port", str(port), "--kv-cache-mib", "8"]
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy()
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else "exited"
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "tether serve did not become healthy"
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


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
