"""EngineConfig: safe defaults, and each bad value rejected with a message naming it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tether.engine import EngineConfig, PreemptionMode
from tether.errors import ConfigError


def test_defaults() -> None:
    config = EngineConfig(num_blocks=128)
    assert (config.block_size, config.max_num_seqs, config.max_num_batched_tokens) == (16, 64, 512)
    assert config.max_model_len == 2048
    assert config.enable_prefix_caching is True
    assert config.preemption_mode is PreemptionMode.RECOMPUTE
    assert config.max_blocks_per_seq == 128
    assert config.lanes == 1
    assert config.adapt_threads is False
    assert (config.attention_block_tokens, config.blockwise_min_context) == (512, 4096)
    assert EngineConfig(num_blocks=128, attention_block_tokens=0).attention_block_tokens == 0


def test_preemption_mode_accepts_its_string_value() -> None:
    config = EngineConfig(num_blocks=128, preemption_mode="recompute")
    assert config.preemption_mode is PreemptionMode.RECOMPUTE


def test_config_is_frozen() -> None:
    config = EngineConfig(num_blocks=128)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_blocks = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"num_blocks": 0}, "num_blocks = 0: expected an integer of at least 1"),
        ({"block_size": -4}, "block_size = -4: expected an integer of at least 1"),
        ({"block_size": 16.0}, "block_size = 16.0: expected an integer"),
        ({"max_num_seqs": True}, "max_num_seqs = True: expected an integer"),
        ({"max_num_batched_tokens": "512"}, "max_num_batched_tokens = '512': expected an integer"),
        ({"max_model_len": 0}, "max_model_len = 0: expected an integer of at least 1"),
        ({"lanes": 0}, "lanes = 0: expected an integer of at least 1"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching = 'yes': expected true or false"),
        ({"adapt_threads": 1}, "adapt_threads = 1: expected true or false"),
        ({"preemption_mode": "never"}, "preemption_mode = 'never': expected one of 'recompute', 'swap'"),
        ({"preemption_mode": "swap"}, "preemption_mode = 'swap' swaps KV to the host tier: expected"),
        ({"preemption_mode": "auto"}, "preemption_mode = 'auto' swaps KV to the host tier: expected"),
        ({"kv_host_tier_mib": -1}, "kv_host_tier_mib = -1: expected an integer of at least 0"),
        ({"kv_disk_tier_mib": 1.5}, "kv_disk_tier_mib = 1.5: expected an integer"),
        ({"kv_disk_tier_dir": ""}, "kv_disk_tier_dir = '': expected a folder path or None"),
        (
            {"kv_disk_tier_dir": "/tmp/kv", "kv_disk_tier_mib": 0},
            "kv_disk_tier_mib = 0 with kv_disk_tier_dir",
        ),
        (
            {"kv_disk_tier_dir": "/tmp/kv", "enable_prefix_caching": False},
            "keeps evicted prefix-cache blocks: expected enable_prefix_caching = true",
        ),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "max_num_batched_tokens = 32: expected at"),
        ({"num_blocks": 127}, "num_blocks = 127: expected at least 128"),
        ({"num_blocks": 4, "block_size": 4, "max_model_len": 17}, "num_blocks = 4: expected at least 5"),
        ({"attention_block_tokens": 24}, "attention_block_tokens = 24: expected 0 (off: the full score"),
        ({"attention_block_tokens": -16}, "positive multiple of block_size (16)"),
        ({"attention_block_tokens": 1.5}, "attention_block_tokens = 1.5"),
        ({"blockwise_min_context": 0}, "blockwise_min_context = 0: expected an integer of at least 1"),
    ],
)
def test_bad_values_are_rejected_with_the_field_and_what_is_accepted(
    overrides: dict[str, Any], expected: str
) -> None:
    values: dict[str, Any] = {"num_blocks": 128, **overrides}
    with pytest.raises(ConfigError, match=r"^engine: ") as error:
        EngineConfig(**values)
    assert expected in str(error.value)
