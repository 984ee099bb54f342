"""int8 weight-only quantization of the transformer blocks' Linear layers, chosen at load time.

Each output channel gets one symmetric scale (its largest |weight| / 127); activations stay in float and
the matmul runs in float on the dequantized weight. Embeddings, norms and the output head stay in float.
This saves memory, not time: on CPUs without a fast int8 kernel, decoding is no faster than in float.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tether.errors import ConfigError, TetherError
from tether.models.transformer import CausalLM

INT8_MAX = 127

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


class QuantizationError(TetherError, ValueError):
    """A weight update does not fit a quantized model (unknown name, wrong shape)."""


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (int8 [out, in], float32 scales [out]), w ~= q * scale[:, None].

    Each row's scale is its largest |weight| / 127; an all-zero row gets scale 1 and stays exactly zero.
    """
    assert weight.dim() == 2, f"expected a 2-d weight, got shape {tuple(weight.shape)}"
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class QuantizedLinear(nn.Module):
    """A bias-optional Linear holding int8 weights and float32 per-output-channel scales as buffers."""

    qweight: torch.Tensor
    scale: torch.Tensor
    bias: nn.Parameter | None

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> QuantizedLinear:
        module = cls(linear.in_features, linear.out_features, linear.bias)
        module.set_weight(linear.weight)
        return module

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor) -> None:
        """Quantize a float weight [out, in] into this layer (used at load and on weight updates)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise QuantizationError(
                f"weight of shape {tuple(weight.shape)} does not fit a quantized layer of "
                f"{self.in_features} -> {self.out_features} features; expected shape "
                f"{(self.out_features, self.in_features)}"
            )
        q, scale = quantize_weight(weight)
        self.qweight = q.to(weight.device)
        self.scale = scale.to(weight.device)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight this layer computes with."""
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The per-row scale commutes with the matmul: scaling the [.., out] result is cheaper than the weight.
        out = F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_int8(model: CausalLM) -> CausalLM:
    """Replace every Linear inside the transformer blocks by a QuantizedLinear, in place."""
    for layer in model.model.layers:
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, QuantizedLinear.from_linear(child))
    return model


QUANTIZERS: dict[str, Callable[[CausalLM], CausalLM]] = {"int8": quantize_int8}


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
    return len(items)
