"""`tether gateway bench --routing`: prefix-aware routing against round-robin over real `tether serve`
replicas. A small run of a tiny model by default; the issue's figure (SmolLM2, 8 prompts x 50) is slow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tether.cli.main import app
from tether.errors import ConfigError
from tether.gateway.routing_bench import RoutingBenchConfig, run_routing_bench

runner = CliRunner()
KEYS = {
    "cached_share_prefix",
    "cached_share_round_robin",
    "cached_share_ratio",
    "throughput_ratio",
    "failed_requests_after_kill",
    "streams_cut_by_kill",
    "median_latency_s_prefix",
    "median_latency_s_round_robin",
    "machine",
    "model",
    "kv_cache_mib",
    "prompt_tokens_min",
}


def test_prefix_routing_caches_more_than_round_robin_and_a_killed_replica_fails_no_request(
    tiny_path: Path,
) -> None:
    # two replicas, not the figure's three: each phase starts its replicas afresh, and starting is most of
    # this test's time
    config = RoutingBenchConfig(
        tiny_path, prompts=6, requests_per_prompt=5, replicas=2, kill_requests_per_prompt=4
    )
    result = run_routing_bench(config).as_dict()
    assert set(result) >= KEYS
    assert result["prompt_tokens_min"] >= 1024
    assert 2.5 < result["kv_prefixes_per_replica"] < 4.5
    assert result["failed_requests_prefix"] == result["failed_requests_round_robin"] == 0
    assert result["cached_share_prefix"] > result["cached_share_round_robin"]
    assert result["failed_requests_after_kill"] == 0


@pytest.mark.slow
def test_with_smollm2_prefix_routing_doubles_the_cached_share_and_raises_throughput(
    smollm2_folder: Path,
) -> None:
    result = run_routing_bench(RoutingBenchConfig(smollm2_folder)).as_dict()
    print(json.dumps(result))
    assert result["prompt_tokens_min"] >= 1024
    assert result["cached_share_ratio"] >= 2
    assert result["throughput_ratio"] > 1
    assert result["failed_requests_after_kill"] == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--prompts", "0"], "prompts = 0: expected an integer >= 1"),
        (["--replicas", "1"], "replicas = 1: expected at least 2"),
    ],
)
def test_the_routing_bench_refuses_bad_sizes(tiny_path: Path, options: list[str], message: str) -> None:
    result = runner.invoke(app, ["gateway", "bench", "--routing", "--model", str(tiny_path), *options])
    assert result.exit_code != 0 and message in result.output


def test_the_routing_bench_refuses_a_folder_that_is_no_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json there"):
        RoutingBenchConfig(tmp_path)
