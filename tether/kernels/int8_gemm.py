"""Weight-only int8 matmul for CPU float32 rows: x @ (q * scale[:, None]).T + bias, in a small C kernel.

Decoding is bound by reading the weights: float32 moves 4 bytes per weight and step, int8 moves 1. The
kernel (`_int8mm.c`) widens the int8 weights to float32 in registers and multiplies in float32, so its
result is the dequantize-then-float matmul's up to summation order (each output sums over k in order,
`TOLERANCE`). The AVX-512 and AVX2 paths give the same bits, and a row's result does not depend on the
rows sharing the call. Which path runs is a pure function of the CPU's features (`int8_kernel`), so the
AVX2 and portable paths can be tested on a machine that has AVX-512: pass the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F

from tether.kernels import (
    _int8mm,  # after torch: its OpenMP runtime is then the one the kernel links to
    cpu,
)
from tether.kernels.cpu import CpuFeature

# Output channels per packed panel (`_int8mm.c`).
PANEL = 32

# |kernel - dequantized float matmul| <= TOLERANCE * sum_k |x[m, k]| * |w[n, k]| per output: float32 sums
# of K terms in another order differ by a few units of the last place times K, far below this.
TOLERANCE = 1e-5


class Int8Kernel(Enum):
    AVX512 = 2
    AVX2 = 1
    PORTABLE = 0


def int8_kernel(features: frozenset[CpuFeature]) -> Int8Kernel:
    """The path a weight-only int8 matmul takes on a machine with `features`."""
    if CpuFeature.AVX512F in features:
        return Int8Kernel.AVX512
    if CpuFeature.AVX2_FMA in features:
        return Int8Kernel.AVX2
    return Int8Kernel.PORTABLE


def available(kernel: Int8Kernel) -> bool:
    """Whether this CPU can run `kernel` (the C kernel's own check, for tests of every path)."""
    return bool(_int8mm.supports(kernel.value))


@dataclass(frozen=True)
class PackedInt8:
    """An int8 weight [out, in] in the kernel's layout: panels [ceil(out / 32), in, 32] of int8, k-major,
    the last panel padded with zero rows; scales and biases float32, padded to the panels' width."""

    panels: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int


def check_weight(qweight: torch.Tensor) -> None:
    """A weight the int8 kernels pack (this one and `w8a8_gemm`'s): 2-d int8 on the CPU."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.device.type != "cpu":
        raise ValueError(
            f"expected a 2-d int8 CPU weight, got {qweight.dtype} of shape {tuple(qweight.shape)} "
            f"on {qweight.device}"
        )


def check_vectors(out_features: int, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Per-output scales (and bias) that fit `out_features`."""
    for name, vector in (("scale", scale), ("bias", bias)):
        if vector is not None and tuple(vector.shape) != (out_features,):
            raise ValueError(f"{name} of shape {tuple(vector.shape)} does not fit {out_features} outputs")


def widen(vector: torch.Tensor, padded: int) -> torch.Tensor:
    """A per-output vector as the kernels read it: float32, `padded` zeros past the last output."""
    return F.pad(vector.detach().to(torch.float32, copy=True), (0, padded)).contiguous()


def pack(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> PackedInt8:
    """Pack an int8 weight [out, in] with its per-output float scales [out] (and bias [out])."""
    check_weight(qweight)
    out_features, in_features = qweight.shape
    if in_features < 1 or out_features < 1:
        raise ValueError(f"cannot pack an empty weight of shape {tuple(qweight.shape)}")
    check_vectors(out_features, scale, bias)
    padded = -out_features % PANEL
    panels = F.pad(qweight.detach(), (0, 0, 0, padded)).view(-1, PANEL, in_features).transpose(1, 2)
    return PackedInt8(
        panels=panels.contiguous(),
        scale=widen(scale, padded),
        bias=None if bias is None else widen(bias, padded),
        out_features=out_features,
        in_features=in_features,
    )


def stack(parts: list[PackedInt8]) -> PackedInt8:
    """Several packed weights of the same input as one, outputs in order (one call for q, k and v): the
    parts' rows are repacked together, so the output splits by each part's `out_features`."""
    if len({part.in_features for part in parts}) != 1 or not parts:
        raise ValueError("stacked int8 weights must share their input features")
    rows = [part.panels.transpose(1, 2).reshape(-1, part.in_features)[: part.out_features] for part in parts]
    scales = [part.scale[: part.out_features] for part in parts]
    biases = [part.bias[: part.out_features] for part in parts if part.bias is not None]
    if biases and len(biases) != len(parts):
        raise ValueError("stacked int8 weights must all have a bias or none")
    return pack(torch.cat(rows), torch.cat(scales), torch.cat(biases) if biases else None)


def supports(x: torch.Tensor) -> bool:
    """Whether rows `x` can run through the kernel: CPU float32, no autograd, no autocast."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and not (torch.is_grad_enabled() and x.requires_grad)
        and not torch.is_autocast_enabled("cpu")
    )


def linear(x: torch.Tensor, packed: PackedInt8, kernel: Int8Kernel | None = None) -> torch.Tensor:
    """x [..., in] @ dequantized weight.T + bias through the C kernel; `kernel` defaults to this CPU's."""
    if not supports(x) or x.shape[-1] != packed.in_features:
        raise ValueError(
            f"int8 linear: expected CPU float32 rows of {packed.in_features} features outside autograd, "
            f"got {x.dtype} of shape {tuple(x.shape)} on {x.device}"
        )
    chosen = int8_kernel(cpu.detected()) if kernel is None else kernel
    rows = x.reshape(-1, packed.in_features).contiguous()
    out = torch.empty(rows.shape[0], packed.out_features, dtype=torch.float32)
    if rows.shape[0] > 0:
        _int8mm.matmul(
            rows.data_ptr(),
            packed.panels.data_ptr(),
            packed.scale.data_ptr(),
            0 if packed.bias is None else packed.bias.data_ptr(),
            out.data_ptr(),
            rows.shape[0],
            packed.out_features,
            packed.in_features,
            torch.get_num_threads(),
            chosen.value,
        )
    return out.reshape(*x.shape[:-1], packed.out_features)
