"""The served app with KV tiers: a server restarted on the same disk tier serves a known prefix from it
(reported as cached tokens, same output), `/metrics` counts the tiers, and bad tier flags of `tether
serve` fail with the flag's name before a model loads."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from tether.cli.main import app as cli
from tether.engine.async_engine import AsyncEngine
from tether.engine.llm_engine import LLMEngine
from tether.errors import ConfigError
from tether.serving.app import create_app
from tether.serving.launcher import kv_tier_options

PROMPT = list(range(5, 205))  # 200 tokens: 12 full blocks of 16 before the last token's


def serve_once(model: Path, disk_dir: Path, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Start a server on `disk_dir`, send one completion, scrape /metrics, shut it down."""
    engine, tokenizer = LLMEngine.from_pretrained(
        model, kv_cache_mib=4, max_model_len=256, kv_disk_tier_dir=str(disk_dir), kv_disk_tier_mib=64
    )
    async_engine = AsyncEngine(engine)
    async_engine.start()

    async def send() -> tuple[dict[str, Any], str]:
        transport = httpx.ASGITransport(app=create_app(async_engine, tokenizer, "tiny"))
        async with httpx.AsyncClient(transport=transport, base_url="http://tether", timeout=60) as client:
            reply = await client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            return reply.json(), (await client.get("/metrics")).text

    try:
        return asyncio.run(send())
    finally:
        async_engine.shutdown()


def test_a_restarted_server_serves_a_known_prefix_from_the_disk_tier(tiny_path: Path, tmp_path: Path) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    first, _ = serve_once(tiny_path, tmp_path, body)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second, metrics = serve_once(tiny_path, tmp_path, body)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 12 * 16
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert 'tether_engine_kv_tier_hits_total{tier="disk"} 192.0' in metrics
    assert 'tether_engine_kv_tier_bytes_total{direction="in",tier="disk"}' in metrics
    assert 'tether_engine_preemptions_total{mode="swap"} 0.0' in metrics
    assert "tether_engine_recomputed_tokens_total 0.0" in metrics


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            (0, None, 4096, "swap"),
            "--preemption-mode = 'swap' swaps KV to the host tier: expected --kv-host-mib",
        ),
        ((0, None, 4096, "sometimes"), "--preemption-mode = 'sometimes': expected one of 'recompute'"),
        ((-1, None, 4096, "recompute"), "--kv-host-mib = -1: expected an integer of at least 0"),
        ((0, Path("/tmp/kv"), 0, "recompute"), "--kv-disk-mib = 0 with --kv-disk-dir = '/tmp/kv'"),
    ],
)
def test_bad_tier_flags_are_refused_by_their_name(options: tuple[Any, ...], expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        kv_tier_options(*options)
    assert expected in str(error.value)


def test_tether_serve_refuses_swap_without_a_host_tier_before_loading(tmp_path: Path) -> None:
    empty = tmp_path / "model"  # loading it would fail: the flags must be checked first
    empty.mkdir()
    result = CliRunner().invoke(
        cli, ["serve", "--model", str(empty), "--port", "1", "--preemption-mode", "auto"]
    )
    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert "error: --preemption-mode = 'auto' swaps KV to the host tier" in output


def test_tier_flags_pass_through_as_engine_options(tmp_path: Path) -> None:
    assert kv_tier_options(64, tmp_path, 128, "auto") == {
        "kv_host_tier_mib": 64,
        "kv_disk_tier_dir": str(tmp_path),
        "kv_disk_tier_mib": 128,
        "preemption_mode": "auto",
    }
