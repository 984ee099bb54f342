"""`max_model_len`: checked against the model's context limit (with rope scaling) and the KV budget, with
messages that say what fits; the default as before the setting existed; and `from_pretrained` using it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tether.engine.context_limits import kv_bytes_per_token, kv_cache_blocks, resolve_max_model_len
from tether.engine.llm_engine import LLMEngine
from tether.errors import ConfigError
from tether.models.config import ModelConfig, RopeScaling
from tether.testing import make_tiny_model

SMOLLM2_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
}


def smollm2_shape(rope: RopeScaling | None = None) -> ModelConfig:
    """SmolLM2-135M's shapes (30 layers, 3 KV heads of 64, 8192 positions), without its weights."""
    config = ModelConfig.from_dict(SMOLLM2_SHAPE)
    return config if rope is None else config.with_rope_scaling(rope)


def test_kv_bytes_per_token_is_keys_and_values_of_every_layer_and_kv_head() -> None:
    assert kv_bytes_per_token(smollm2_shape(), torch.float32) == 2 * 30 * 3 * 64 * 4 == 46_080
    assert kv_bytes_per_token(smollm2_shape(), torch.bfloat16) == 23_040


def test_the_default_is_the_least_of_the_context_limit_4096_and_the_cache() -> None:
    assert resolve_max_model_len(smollm2_shape(), None, 1024, 16, torch.float32) == 4096
    assert kv_cache_blocks(smollm2_shape(), 128, 16, torch.float32) == 182
    assert resolve_max_model_len(smollm2_shape(), None, 128, 16, torch.float32) == 182 * 16
    tiny_positions = ModelConfig.from_dict({**SMOLLM2_SHAPE, "max_position_embeddings": 1000})
    assert resolve_max_model_len(tiny_positions, None, 1024, 16, torch.float32) == 1000


def test_smollm2_runs_at_32k_with_yarn_when_the_cache_holds_it() -> None:
    yarn = smollm2_shape(RopeScaling.parse("yarn:4"))
    assert yarn.context_limit == 32768
    assert resolve_max_model_len(yarn, 32768, 1440, 16, torch.float32) == 32768
    assert resolve_max_model_len(yarn, 32768, 720, 16, torch.bfloat16) == 32768


def test_a_length_past_the_cache_says_how_much_cache_it_needs() -> None:
    yarn = smollm2_shape(RopeScaling.parse("yarn:4"))
    expected = (
        r"max_model_len 32,768 needs 1,440 MiB of KV at 46,080 bytes/token; kv_cache_mib 256 holds "
        r"5,824 tokens: raise --kv-cache-mib to at least 1,440 or lower --max-model-len to at most 5,824"
    )
    with pytest.raises(ConfigError, match=expected):
        resolve_max_model_len(yarn, 32768, 256, 16, torch.float32)
    assert resolve_max_model_len(yarn, 5824, 256, 16, torch.float32) == 5824


@pytest.mark.parametrize(
    ("rope", "requested", "message"),
    [
        (
            None,
            32768,
            r"max_model_len 32,768 is past the model's context limit of 8,192 positions "
            r"\(max_position_embeddings 8,192, no rope scaling\): lower --max-model-len to at most 8,192 "
            r"or extend the context with --rope-scaling yarn:4",
        ),
        (
            "yarn:2",
            32768,
            r"context limit of 16,384 positions \(max_position_embeddings 8,192, rope scaling yarn x2 of "
            r"8,192\).*or give a larger --rope-scaling factor",
        ),
    ],
)
def test_a_length_past_the_context_limit_says_what_the_model_supports(
    rope: str | None, requested: int, message: str
) -> None:
    config = smollm2_shape(None if rope is None else RopeScaling.parse(rope))
    with pytest.raises(ConfigError, match=message):
        resolve_max_model_len(config, requested, 4096, 16, torch.float32)


@pytest.mark.parametrize("requested", [0, -5, True, 2.5, "4096"])
def test_a_length_that_is_no_positive_integer_is_refused(requested: object) -> None:
    with pytest.raises(ConfigError, match=r"max_model_len = .*: expected an integer of at least 1"):
        resolve_max_model_len(smollm2_shape(), requested, 256, 16, torch.float32)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen2", seed=0)


def test_from_pretrained_takes_max_model_len_and_rope_scaling(tiny_path: Path) -> None:
    """The tiny model has 2048 positions and 512 KV bytes a token: 8 MiB hold 16,384 tokens."""
    default, _ = LLMEngine.from_pretrained(tiny_path, kv_cache_mib=8)
    assert default.config.max_model_len == 2048
    engine, _ = LLMEngine.from_pretrained(
        tiny_path, kv_cache_mib=8, max_model_len=8192, rope_scaling=RopeScaling.parse("yarn:4")
    )
    assert engine.config.max_model_len == 8192
    assert engine.runner.model.config.rope_scaling == RopeScaling("yarn", 4.0, 2048)
    with pytest.raises(ConfigError, match="context limit of 2,048 positions"):
        LLMEngine.from_pretrained(tiny_path, kv_cache_mib=8, max_model_len=8192)
    with pytest.raises(ConfigError, match="raise --kv-cache-mib to at least 4"):
        LLMEngine.from_pretrained(
            tiny_path, kv_cache_mib=1, max_model_len=8192, rope_scaling=RopeScaling.parse("yarn:4")
        )


def test_a_length_that_cannot_fit_fails_before_the_weights_load(tiny_path: Path, tmp_path: Path) -> None:
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((tiny_path / "config.json").read_text())
    with pytest.raises(ConfigError, match="past the model's context limit"):
        LLMEngine.from_pretrained(config_only, kv_cache_mib=8, max_model_len=8192)
