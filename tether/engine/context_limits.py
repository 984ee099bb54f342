"""How long a sequence the engine holds (`max_model_len`): at most the positions the model supports (its
max_position_embeddings, extended by rope scaling: `ModelConfig.context_limit`) and at most what the KV
cache's budget holds, with errors that say what would fit. Pure arithmetic over the model's config; the
engine allocates nothing here.
"""

from __future__ import annotations

import math

import torch

from tether.errors import ConfigError
from tether.models.config import ModelConfig, RopeType

MIB = 1024 * 1024

DEFAULT_MAX_MODEL_LEN = 4096
"""`max_model_len` when none is asked for (capped lower by the model and the cache): the engine's limit
before it was a setting, kept so that a default engine's memory per sequence and its tests stay as they
were; longer contexts are asked for explicitly."""


def kv_bytes_per_token(model_config: ModelConfig, dtype: torch.dtype) -> int:
    """KV cache bytes one token takes in `dtype` (`ModelConfig.kv_bytes_per_token`)."""
    return model_config.kv_bytes_per_token(dtype.itemsize)


def kv_cache_blocks(model_config: ModelConfig, kv_cache_mib: int, block_size: int, dtype: torch.dtype) -> int:
    """Whole KV blocks of `block_size` tokens that `kv_cache_mib` holds (at least one)."""
    return max(1, kv_cache_mib * MIB // (kv_bytes_per_token(model_config, dtype) * block_size))


def resolve_max_model_len(
    model_config: ModelConfig,
    requested: int | None,
    kv_cache_mib: int,
    block_size: int,
    dtype: torch.dtype,
) -> int:
    """`requested` once checked against the model's context limit and the KV budget; None: the least of
    the context limit, `DEFAULT_MAX_MODEL_LEN` and what the cache holds."""
    holds = kv_cache_blocks(model_config, kv_cache_mib, block_size, dtype) * block_size
    limit = model_config.context_limit
    if requested is None:
        return min(limit, DEFAULT_MAX_MODEL_LEN, holds)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ConfigError(f"max_model_len = {requested!r}: expected an integer of at least 1")
    if requested > limit:
        raise ConfigError(
            f"max_model_len {requested:,} is past the model's context limit of {limit:,} positions "
            f"({_limit_reason(model_config)}): lower --max-model-len to at most {limit:,}"
            f"{_rope_hint(model_config, requested)}"
        )
    if requested > holds:
        per_token = kv_bytes_per_token(model_config, dtype)
        needed_mib = math.ceil(-(-requested // block_size) * block_size * per_token / MIB)
        raise ConfigError(
            f"max_model_len {requested:,} needs {needed_mib:,} MiB of KV at {per_token:,} bytes/token; "
            f"kv_cache_mib {kv_cache_mib:,} holds {holds:,} tokens: raise --kv-cache-mib to at least "
            f"{needed_mib:,} or lower --max-model-len to at most {holds:,}"
        )
    return requested


def _limit_reason(model_config: ModelConfig) -> str:
    positions = f"max_position_embeddings {model_config.max_position_embeddings:,}"
    scaling = model_config.rope_scaling
    if scaling.rope_type is RopeType.DEFAULT:
        return f"{positions}, no rope scaling"
    return f"{positions}, rope scaling {scaling.describe()} of {scaling.original_length:,}"


def _rope_hint(model_config: ModelConfig, requested: int) -> str:
    if model_config.rope_scaling.rope_type is not RopeType.DEFAULT:
        return " or give a larger --rope-scaling factor"
    factor = math.ceil(requested / model_config.max_position_embeddings)
    return f" or extend the context with --rope-scaling yarn:{factor}"
