"""Acceptance on the real SmolLM2-135M engine (slow): the official openai client through the gateway,
streaming and not, usage and cost exact to the token for cache misses and hits, a revoked key refused,
and the fast tier's time to first token under a saturated engine."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tether.chat import Usage
from tether.gateway import Tier

from .conftest import engine_server, live_gateway, make_config
from .helpers import expected_cost, serve
from .priority import ttft_medians

pytestmark = pytest.mark.slow

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2_url(smollm2_folder: Path) -> Iterator[str]:
    with engine_server(smollm2_folder, SMOLLM2, kv_cache_mib=64, max_model_len=1024) as url:
        yield url


async def test_openai_client_through_the_gateway_is_billed_to_the_token(
    smollm2_url: str, tmp_path: Path
) -> None:
    config = make_config(smollm2_url, f"sqlite:///{tmp_path}/ledger.db", model=SMOLLM2)
    async with serve(config) as served:
        secret, record = served.gateway.keys.create("acme", Tier.STANDARD, config.default_key_limits)
        client = served.openai(secret)
        system = f"{uuid.uuid4().hex} You are a terse assistant. Answer in one short sentence. " * 3
        messages: Any = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]
        usages = []
        whole = await client.chat.completions.create(model=SMOLLM2, messages=messages, max_tokens=12)
        assert whole.choices[0].message.content and whole.usage is not None
        details = whole.usage.prompt_tokens_details
        usages.append(
            Usage(
                whole.usage.prompt_tokens,
                details.cached_tokens or 0 if details else 0,
                whole.usage.completion_tokens,
            )
        )
        stream = await client.chat.completions.create(
            model=SMOLLM2,
            messages=messages,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        text = ""
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                cached = (
                    chunk.usage.prompt_tokens_details.cached_tokens
                    if chunk.usage.prompt_tokens_details
                    else 0
                )
                usages.append(Usage(chunk.usage.prompt_tokens, cached or 0, chunk.usage.completion_tokens))
        assert text and len(usages) == 2
        assert (
            usages[0].cached_tokens == 0 and usages[1].cached_tokens >= 32
        )  # the repeat hits the prefix cache
        await served.gateway.flush()
        (row,) = served.gateway.ledger.report("acme", 0)
        assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (
            sum(u.prompt_tokens for u in usages),
            sum(u.cached_tokens for u in usages),
            sum(u.completion_tokens for u in usages),
        )
        assert row.cost_usd == sum(expected_cost(u, Tier.STANDARD) for u in usages)
        served.gateway.keys.revoke(record.key_id)
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model=SMOLLM2, messages=messages, max_tokens=4)


@pytest.fixture(scope="module")
def saturable_url(smollm2_folder: Path) -> Iterator[str]:
    with engine_server(smollm2_folder, SMOLLM2, kv_cache_mib=64, max_model_len=512, max_num_seqs=4) as url:
        yield url


async def test_fast_tier_first_token_is_three_times_sooner_on_smollm2(
    saturable_url: str, tmp_path: Path
) -> None:
    config = make_config(saturable_url, f"sqlite:///{tmp_path}/ledger.db", model=SMOLLM2)
    with live_gateway(config) as (url, gateway):
        fast, standard = await ttft_medians(
            url, gateway, SMOLLM2, background=8, probes=5, background_tokens=48
        )
    ratio = standard / fast
    print(
        f"SmolLM2 TTFT median: fast {fast * 1e3:.1f} ms, standard {standard * 1e3:.1f} ms, ratio {ratio:.1f}"
    )
    assert standard >= 3 * fast
