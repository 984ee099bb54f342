"""int8 weight-only quantization of the transformer blocks' Linear layers, chosen at load time.

Each output channel gets one symmetric scale (its largest |weight| / 127); activations stay in float and
the matmul widens the int8 weights to float (`quantized_linear`). Embeddings, norms and the output head
stay in float. On CPU the projections run through the int8 kernel (`tether.kernels.int8_gemm`), which
reads a quarter of float32's bytes: decoding is faster than in float wherever it waits on the weights.
`w8a8` rounds the layers' input rows to int8 as well, in blocks of 32, for byte-by-byte dot products
(`QuantizedLinear.dynamic`): faster where a batch of rows makes float32 wait on arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from tether.errors import ConfigError
from tether.models.quantized_linear import INT8_MAX, QuantizationError, QuantizedLinear, quantize_weight
from tether.models.transformer import CausalLM

__all__ = [
    "INT8_MAX",
    "QUANTIZERS",
    "REFERENCE_TEXT",
    "QuantizationError",
    "QuantizedLinear",
    "get_quantizer",
    "is_quantized",
    "quantize_int8",
    "quantize_weight",
    "update_quantized_weights",
]

# A fixed English paragraph: the text on which quantized and float models are compared (perplexity).
REFERENCE_TEXT = (
    "The river town woke slowly in the grey light of early spring. Fishermen carried their nets down to "
    "the water while the baker opened his shutters and set the first loaves on the counter. Children ran "
    "along the narrow streets on their way to school, and an old man sat on a bench by the bridge, reading "
    "yesterday's newspaper as if nothing in the world could hurry him. By noon the market square was full: "
    "farmers sold apples, cheese and honey, a musician played the violin near the fountain, and the smell "
    "of coffee drifted from the small cafe on the corner. In the afternoon clouds gathered over the hills, "
    "and a light rain began to fall, sending everyone indoors. When the evening came, the lamps were lit "
    "one by one, and the town grew quiet again, waiting for another ordinary day."
)


def quantize_int8(model: CausalLM, dynamic: bool = False) -> CausalLM:
    """Replace every Linear inside the transformer blocks by a QuantizedLinear, in place; with `dynamic`,
    its input rows are rounded to int8 too (`QuantizedLinear.dynamic`)."""
    for layer in model.model.layers:
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, QuantizedLinear.from_linear(child, dynamic))
    return model


def quantize_w8a8(model: CausalLM) -> CausalLM:
    """int8 weights and int8 activations in blocks of 32 (`quantize_int8` with `dynamic`), the output
    head included (a fifth of SmolLM2's multiply-adds; +0.2% perplexity): the embedding stays in float,
    and a tied head is quantized again whenever the embedding is updated."""
    quantize_int8(model, dynamic=True)
    model.add_module("lm_head", QuantizedLinear.from_linear(model.lm_head, dynamic=True))
    return model


TIED_EMBEDDING = "model.embed_tokens.weight"
"""The parameter a tied output head shares (`CausalLM.tie_weights`)."""

QUANTIZERS: dict[str, Callable[[CausalLM], CausalLM]] = {"int8": quantize_int8, "w8a8": quantize_w8a8}


def get_quantizer(method: str) -> Callable[[CausalLM], CausalLM]:
    """The in-place quantizer named `method` (a key of `QUANTIZERS`)."""
    quantizer = QUANTIZERS.get(method)
    if quantizer is None:
        raise ConfigError(f"quantization = {method!r}: expected one of {', '.join(map(repr, QUANTIZERS))}")
    return quantizer


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(module, QuantizedLinear) for module in model.modules())


@torch.no_grad()
def update_quantized_weights(
    model: nn.Module, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
) -> int:
    """Hot weight update of a quantized model: float weights of quantized layers are re-quantized, other
    parameters copied in place. Names and shapes are those of the float model; all are checked first."""
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    quantized = {
        f"{name}.weight": module
        for name, module in model.named_modules()
        if isinstance(module, QuantizedLinear)
    }
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in items:
        if name in quantized:
            expected: tuple[int, ...] = (quantized[name].out_features, quantized[name].in_features)
        elif name in params:
            expected = tuple(params[name].shape)
        else:
            known = sorted(quantized) + sorted(params)
            raise QuantizationError(
                f"unknown parameter {name!r} in a quantized model; names look like {known[:3]}"
            )
        if tuple(tensor.shape) != expected:
            raise QuantizationError(f"parameter {name!r} has shape {expected}, got {tuple(tensor.shape)}")
        if name in quantized and not tensor.is_floating_point():
            raise QuantizationError(
                f"parameter {name!r}: expected a float tensor to quantize, got {tensor.dtype}"
            )
    for name, tensor in items:
        if name in quantized:
            quantized[name].set_weight(tensor.to(quantized[name].qweight.device))
        else:
            params[name].copy_(tensor.to(device=params[name].device, dtype=params[name].dtype))
    head = quantized.get("lm_head.weight")
    tied = isinstance(model, CausalLM) and model.config.tie_word_embeddings
    if head is not None and tied and any(name == TIED_EMBEDDING for name, _ in items):
        head.set_weight(params[TIED_EMBEDDING])  # the quantized head is a copy of the embedding, not it
    return len(items)
