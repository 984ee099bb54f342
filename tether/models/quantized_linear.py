"""The int8 weight-only Linear layer: int8 weights with one float32 scale per output channel.

On CPU float32 rows outside autograd it runs through the int8 kernel (`tether.kernels.int8_gemm`), which
reads a quarter of float32's bytes per weight: SmolLM2's decode projections ran 2.7-3x faster than
oneDNN's float32 at 1 row and at par from 16 rows with the weights in cache (benchmarks/int8_matmul.py).
Elsewhere (autograd, other dtypes or devices) it multiplies by the dequantized weight in float. Both
compute the dequantize-then-float matmul up to summation order.

With `dynamic` activations (the `w8a8` quantizer) a layer also rounds its input rows to int8 in blocks of
32 (`tether.kernels.w8a8_gemm`) and multiplies bytes by bytes: on a batch of decode rows, where float32 is
bound by arithmetic, VNNI's byte dot products ran SmolLM2's projections 1.8-3.4x faster than float32.
Its fallback computes the same rounding in torch ops (`w8a8_gemm.reference`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tether.errors import TetherError
from tether.kernels import int8_gemm, w8a8_gemm

INT8_MAX = 127


Packed = int8_gemm.PackedInt8 | w8a8_gemm.PackedW8A8
"""A weight in the layout of the kernel that runs it (weight-only or dynamic int8)."""


def kernel_linear(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    if isinstance(packed, w8a8_gemm.PackedW8A8):
        return w8a8_gemm.linear(x, packed)
    return int8_gemm.linear(x, packed)


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


def _identity(tensor: torch.Tensor | None) -> tuple[int, int]:
    """What changes when a tensor is replaced or written in place (its storage, its version)."""
    if tensor is None:
        return (0, 0)
    return (tensor.data_ptr(), -1 if tensor.is_inference() else tensor._version)


class QuantizedLinear(nn.Module):
    """A bias-optional Linear holding int8 weights and float32 per-output-channel scales as buffers; the
    kernel's packed copy (of this layer, or of it stacked with the layers sharing its input) is kept
    outside the state dict and rebuilt when a weight, scale or bias is replaced or written in place."""

    qweight: torch.Tensor
    scale: torch.Tensor
    bias: nn.Parameter | None

    def __init__(
        self, in_features: int, out_features: int, bias: torch.Tensor | None = None, dynamic: bool = False
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.dynamic = dynamic
        """Round the input rows to int8 too (per block of 32, `w8a8_gemm`), not only the weights."""
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._packed: dict[int, tuple[tuple[tuple[int, int], ...], Packed]] = {}

    @classmethod
    def from_linear(cls, linear: nn.Linear, dynamic: bool = False) -> QuantizedLinear:
        module = cls(linear.in_features, linear.out_features, linear.bias, dynamic)
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

    def _identity(self) -> tuple[tuple[int, int], ...]:
        return (_identity(self.qweight), _identity(self.scale), _identity(self.bias))

    def kernel_runs(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through this layer's C kernel (else its torch fallback)."""
        if self.qweight.device.type != "cpu":
            return False
        if self.dynamic:
            return w8a8_gemm.supports(x) and w8a8_gemm.packable(self.in_features)
        return int8_gemm.supports(x)

    def packed_with(self, others: Sequence[QuantizedLinear] = ()) -> Packed:
        """This layer's weight, stacked with `others`' along the outputs, in its kernel's layout (cached)."""
        layers = (self, *others)
        key = tuple(part for layer in layers for part in layer._identity())
        cached = self._packed.get(len(others))
        if cached is not None and cached[0] == key:
            return cached[1]
        packed: Packed
        if self.dynamic:
            biases: list[torch.Tensor] = [layer.bias for layer in layers if layer.bias is not None]
            if biases and len(biases) != len(layers):
                raise ValueError("stacked int8 weights must all have a bias or none")
            packed = w8a8_gemm.pack(
                torch.cat([layer.qweight for layer in layers]),
                torch.cat([layer.scale for layer in layers]),
                torch.cat(biases) if biases else None,
            )
        else:
            parts = [int8_gemm.pack(layer.qweight, layer.scale, layer.bias) for layer in layers]
            packed = parts[0] if not others else int8_gemm.stack(parts)
        self._packed[len(others)] = (key, packed)
        return packed

    @property
    def packed_copies(self) -> int:
        """How many packed copies this layer holds: its own, and one per stack it leads."""
        return len(self._packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_runs(x):
            return kernel_linear(x, self.packed_with())
        if self.dynamic:
            return w8a8_gemm.reference(x, self.qweight, self.scale, self.bias)
        # The per-row scale commutes with the matmul: scaling the [.., out] result is cheaper than the weight.
        out = F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        activations = ", int8 activations" if self.dynamic else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8{activations}"


def stacked_int8(x: torch.Tensor, layers: Sequence[QuantizedLinear]) -> list[torch.Tensor] | None:
    """Each layer's projection of `x` from one kernel call over their stacked weights (the same values as
    one call each: every output sums over its own row in order), or None where the kernel does not apply."""
    first = layers[0]
    if not (
        x.numel() > 0 and all(layer.dynamic == first.dynamic for layer in layers) and first.kernel_runs(x)
    ):
        return None
    out = kernel_linear(x, first.packed_with(layers[1:]))
    return list(torch.split(out, [layer.out_features for layer in layers], dim=-1))
