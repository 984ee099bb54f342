"""Dynamic int8 matmul for CPU float32 rows: int8 weights (one scale per output channel) times the rows
quantized to int8 on the fly in blocks of 32 along the inputs (one scale per row and block), in a small C
kernel (`_w8a8mm.c`).

A batch of decode rows makes a projection bound by arithmetic rather than by reading the weights, and
float32 multiplies 16 pairs per AVX-512 instruction; VNNI's vpdpbusd multiplies and sums 64 byte pairs.
The blocks of 32 are llama.cpp's q8 activations (its quantized dot products quantize them so): on SmolLM2
per-block scales cost 0.8% perplexity where one scale per row cost 7%. Every path computes exact int32
block sums and the same float steps after them, so the paths give the same bits, equal to `reference` up
to float rounding (`TOLERANCE`). Which path runs is a pure function of the CPU's features (`w8a8_kernel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F

from tether.kernels import (
    _w8a8mm,  # after torch: its OpenMP runtime is then the one the kernel links to
    cpu,
    int8_gemm,
)
from tether.kernels.cpu import CpuFeature

PANEL = 32
"""Output channels per packed panel."""
BLOCK = 32
"""Inputs sharing one activation scale; the kernel needs in_features to be a multiple of it."""
INT8_MAX = 127

# |kernel - reference| <= TOLERANCE * sum_k |x[m, k]| * |w[n, k]| per output: the reference rescales each
# term in float where the kernel rescales exact integer sums.
TOLERANCE = 1e-5


class W8A8Kernel(Enum):
    VNNI = 2
    AVX2 = 1
    PORTABLE = 0


def w8a8_kernel(features: frozenset[CpuFeature]) -> W8A8Kernel:
    """The path a dynamic int8 matmul takes on a machine with `features`."""
    if CpuFeature.AVX512_VNNI in features:
        return W8A8Kernel.VNNI
    if CpuFeature.AVX2_FMA in features:
        return W8A8Kernel.AVX2
    return W8A8Kernel.PORTABLE


def available(kernel: W8A8Kernel) -> bool:
    """Whether this CPU can run `kernel` (the C kernel's own check, for tests of every path)."""
    return bool(_w8a8mm.supports(kernel.value))


@dataclass(frozen=True)
class PackedW8A8:
    """An int8 weight [out, in] in the kernel's layout: panels [ceil(out / 32), in / 4, 32, 4] of q + 128
    as uint8, the last panel padded with zero weights; scales and biases float32, padded likewise."""

    panels: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int


def packable(in_features: int) -> bool:
    return in_features > 0 and in_features % BLOCK == 0


def pack(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> PackedW8A8:
    """Pack an int8 weight [out, in] (in a multiple of 32) with its per-output scales (and bias)."""
    int8_gemm.check_weight(qweight)
    out_features, in_features = qweight.shape
    if out_features < 1 or not packable(in_features):
        raise ValueError(
            f"cannot pack a weight of shape {tuple(qweight.shape)}: expected outputs and a multiple of "
            f"{BLOCK} inputs"
        )
    int8_gemm.check_vectors(out_features, scale, bias)
    padded = -out_features % PANEL
    shifted = (F.pad(qweight.detach(), (0, 0, 0, padded)).to(torch.int16) + 128).to(torch.uint8)
    panels = shifted.view(-1, PANEL, in_features // 4, 4).transpose(1, 2)
    return PackedW8A8(
        panels=panels.contiguous(),
        scale=int8_gemm.widen(scale, padded),
        bias=None if bias is None else int8_gemm.widen(bias, padded),
        out_features=out_features,
        in_features=in_features,
    )


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., in] rounded to their int8 grid in blocks of 32 (as the kernel quantizes them), in float."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(blocks / scale).clamp(-INT8_MAX, INT8_MAX) * scale).reshape(x.shape).to(x.dtype)


def reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What the kernel computes, in torch ops on any device and dtype, differentiable in x through the
    rounded rows' values (the rounding itself passes no gradient): quantized rows @ dequantized weight."""
    weight = qweight.to(x.dtype) * scale.to(x.dtype)[:, None]
    return F.linear(quantize_rows(x), weight, None if bias is None else bias.to(x.dtype))


# The rows both int8 kernels take: CPU float32, outside autograd and autocast.
supports = int8_gemm.supports


def linear(x: torch.Tensor, packed: PackedW8A8, kernel: W8A8Kernel | None = None) -> torch.Tensor:
    """x [..., in] quantized per block @ the int8 weight.T, rescaled, + bias; `kernel` defaults to this
    CPU's best path."""
    if not supports(x) or x.shape[-1] != packed.in_features:
        raise ValueError(
            f"w8a8 linear: expected CPU float32 rows of {packed.in_features} features outside autograd, "
            f"got {x.dtype} of shape {tuple(x.shape)} on {x.device}"
        )
    chosen = w8a8_kernel(cpu.detected()) if kernel is None else kernel
    rows = x.reshape(-1, packed.in_features).contiguous()
    out = torch.empty(rows.shape[0], packed.out_features, dtype=torch.float32)
    if rows.shape[0] > 0:
        _w8a8mm.matmul(
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
