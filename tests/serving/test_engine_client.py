"""The in-process engine is reached through the same OpenAI app as `tether serve`, and `open_client`
names the client each `--model`/`--base-url` pair means."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tether.chat import ChatRequest
from tether.chat.openai_client import OpenAIClient
from tether.chat.tokens import PromptCounter, estimate_prompt_tokens
from tether.errors import ConfigError
from tether.serving.engine_client import EngineClient, open_client
from tether.testing.scripted import ScriptedClient
from tether.tools import BUILTIN_TOOLS


async def test_the_in_process_engine_answers_a_chat(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    client = EngineClient(str(tiny_model("qwen2")), tmp_path, kv_cache_mib=4, device="cpu")
    try:
        completion = await client.complete(ChatRequest([{"role": "user", "content": "hi"}], max_tokens=5))
    finally:
        await client.close()
    assert completion.usage.completion_tokens >= 1 and completion.usage.prompt_tokens > 0


async def test_the_engine_counts_a_prompt_as_it_prefills_it(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    client = EngineClient(str(tiny_model("qwen2")), tmp_path, kv_cache_mib=4, device="cpu")
    tools = BUILTIN_TOOLS.only(("shell", "finish")).specs()
    request = ChatRequest(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], tools, max_tokens=1
    )
    try:
        assert isinstance(client, PromptCounter)
        counted = client.count_prompt_tokens(request)
        completion = await client.complete(request)
        assert client.max_model_len == 2048  # the tiny model's window
    finally:
        await client.close()
    assert counted == completion.usage.prompt_tokens > estimate_prompt_tokens(request) // 4


def test_open_client_picks_the_client_each_pair_names(tmp_path: Path) -> None:
    script = tmp_path / "s.jsonl"
    script.write_text('{"content": "x"}\n')
    assert isinstance(open_client(f"scripted:{script}", None, tmp_path), ScriptedClient)
    assert isinstance(open_client("m", "http://127.0.0.1:9/v1", tmp_path), OpenAIClient)
    with pytest.raises(ConfigError, match="do not also give --base-url"):
        open_client(f"scripted:{script}", "http://x/v1", tmp_path)
    with pytest.raises(ConfigError, match="no model"):
        open_client(None, None, tmp_path)


async def test_the_in_process_engine_holds_the_length_and_rope_scaling_asked_for(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """The tiny model has 2048 positions; with yarn x4 it holds a prompt of 3000 tokens (one a byte)."""
    folder = str(tiny_model("qwen2"))
    with pytest.raises(ConfigError, match="past the model's context limit of 2,048 positions"):
        EngineClient(folder, tmp_path, kv_cache_mib=8, device="cpu", max_model_len=4096)
    client = EngineClient(
        folder, tmp_path, kv_cache_mib=8, device="cpu", max_model_len=4096, rope_scaling="yarn:4"
    )
    try:
        long = ChatRequest([{"role": "user", "content": "ab" * 1500}], max_tokens=1)
        completion = await client.complete(long)
    finally:
        await client.close()
    assert completion.usage.prompt_tokens > 3000
