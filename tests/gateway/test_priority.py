"""With the engine saturated by standard-tier streams, the fast tier's median time to first token is at
least 3x lower: the gateway sends the tier's priority and the engine's scheduler serves it first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import TINY, engine_server, live_gateway, make_config
from .priority import ttft_medians


@pytest.fixture(scope="module")
def small_engine_url(tiny_path: Path) -> Iterator[str]:
    # four seats: eight long standard streams keep it saturated, four of them always waiting
    with engine_server(tiny_path, TINY, kv_cache_mib=4, max_model_len=256, max_num_seqs=4) as url:
        yield url


async def test_fast_tier_first_token_is_three_times_sooner_under_load(
    small_engine_url: str, tmp_path: Path
) -> None:
    config = make_config(small_engine_url, f"sqlite:///{tmp_path}/ledger.db")
    with live_gateway(config) as (url, gateway):
        fast, standard = await ttft_medians(url, gateway, TINY, background=8, probes=5, background_tokens=200)
    ratio = standard / fast
    print(f"TTFT median: fast {fast * 1e3:.1f} ms, standard {standard * 1e3:.1f} ms, ratio {ratio:.1f}")
    assert standard >= 3 * fast
