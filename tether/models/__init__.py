"""Models: a registry of known models, a local cache of converted checkpoints, and our own decoder code."""

from tether.models.cache import CachedModel, PullError, list_cached, pull
from tether.models.config import ARCHITECTURES, ModelConfig, UnsupportedModelError
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
    "UnknownModelError",
    "UnsupportedModelError",
    "configure_threads",
    "list_cached",
    "load",
    "pull",
    "quantize_int8",
    "update_quantized_weights",
]
