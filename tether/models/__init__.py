"""Models: a registry of known models, a local cache of converted checkpoints, and our own decoder code.

The public names are loaded on first use, so that commands which only look up the registry or the cache
(`tether models list`, `--help`) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tether.models.cache import CachedModel, PullError, list_cached, pull
    from tether.models.config import ARCHITECTURES, ModelConfig, RopeScaling, UnsupportedModelError
    from tether.models.loader import load
    from tether.models.quantize import (
        QUANTIZERS,
        QuantizationError,
        QuantizedLinear,
        quantize_int8,
        update_quantized_weights,
    )
    from tether.models.registry import KNOWN_MODELS, ModelSource, UnknownModelError
    from tether.models.threads import configure_threads
    from tether.models.transformer import CausalLM

_EXPORTS = {
    "CachedModel": "cache",
    "PullError": "cache",
    "list_cached": "cache",
    "pull": "cache",
    "ARCHITECTURES": "config",
    "ModelConfig": "config",
    "RopeScaling": "config",
    "UnsupportedModelError": "config",
    "load": "loader",
    "QUANTIZERS": "quantize",
    "QuantizationError": "quantize",
    "QuantizedLinear": "quantize",
    "quantize_int8": "quantize",
    "update_quantized_weights": "quantize",
    "KNOWN_MODELS": "registry",
    "ModelSource": "registry",
    "UnknownModelError": "registry",
    "configure_threads": "threads",
    "CausalLM": "transformer",
}

__all__ = [
    "ARCHITECTURES",
    "KNOWN_MODELS",
    "QUANTIZERS",
    "CachedModel",
    "CausalLM",
    "ModelConfig",
    "ModelSource",
    "PullError",
    "QuantizationError",
    "QuantizedLinear",
    "RopeScaling",
    "UnknownModelError",
    "UnsupportedModelError",
    "configure_threads",
    "list_cached",
    "load",
    "pull",
    "quantize_int8",
    "update_quantized_weights",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tether.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tether.models.{_EXPORTS[name]}"), name)
