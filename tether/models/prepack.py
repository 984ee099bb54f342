"""Projections through oneDNN with the weight reordered into its blocked layout, for float CPU models.

`F.linear` on CPU calls MKL's sgemm, which on this project's machines (AMD EPYC with AVX-512) runs its
AVX2 code path: about 105 GFLOP/s per core at SmolLM2's decode shapes. oneDNN picks its kernels by the
instruction sets present, whoever made the CPU; with the weight reordered ahead of time it ran the same
projections at 220-255 GFLOP/s with 64 rows and 120-220 with 4-16 rows (one thread). Reordering costs a
pass over the weight, so an inference model keeps the packed copy (`PackedWeight`) and rebuilds it only
when the weight changes; a training forward packs on every call (its weights change at every optimizer
step, in place, and fused optimizers do not count such writes in the tensor's version), which a forward
over whole sequences amortises.

Each row of a packed projection is computed independently of the rows sharing the call: measured equal
bit for bit from 2 rows up to 4,096, with one or two threads (one row alone may take another kernel).
That is what lets a rollout engine and a learner compute the same logprobs (`layers.Linear`). Stacking
weights along their outputs changes no bit either (measured for SmolLM2's and Qwen2's q/k/v and gate/up
shapes, 1-513 rows), so inference computes q, k and v in one call, and gate and up in one: fewer, larger
calls, 8% more decode throughput and a batch-1 step of about 21 ms instead of 28 (SmolLM2, 2 threads).

Where this CPU or torch build cannot pack a dtype (bfloat16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT:
an AVX2-only CPU has neither), projections fall back to `F.linear` (`projection_kernel`).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

from tether.kernels import cpu
from tether.kernels.cpu import CpuFeature

# The kernel is chosen for a batch of about this many rows; any row count runs with the same packed weight.
PACKED_BATCH_HINT = 64

# Rows from which a packed projection's row results no longer depend on the row count.
PACKED_INVARIANT_ROWS = 2


class ProjectionKernel(Enum):
    ONEDNN_PACKED = "oneDNN, prepacked weights"
    TORCH_LINEAR = "torch F.linear (MKL)"


# What packing a dtype's weights needs; other dtypes are never packed.
PACKING_NEEDS = {
    torch.float32: frozenset({CpuFeature.ONEDNN}),
    torch.bfloat16: frozenset({CpuFeature.ONEDNN, CpuFeature.ONEDNN_BF16}),
}


def projection_kernel(features: frozenset[CpuFeature], dtype: torch.dtype) -> ProjectionKernel:
    """The kernel a CPU projection of `dtype` takes on a machine with `features`."""
    needs = PACKING_NEEDS.get(dtype)
    return (
        ProjectionKernel.ONEDNN_PACKED
        if needs is not None and needs <= features
        else ProjectionKernel.TORCH_LINEAR
    )


def supports(weight: torch.Tensor, x: torch.Tensor | None = None) -> bool:
    """Whether a projection by `weight` (of `x`) can run packed: a 2-d CPU weight of a dtype this machine
    packs (`projection_kernel`), the input of the same dtype, no autocast."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and projection_kernel(cpu.detected(), weight.dtype) is ProjectionKernel.ONEDNN_PACKED
        and (x is None or (x.dtype == weight.dtype and x.device.type == "cpu"))
        and not torch.is_autocast_enabled("cpu")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] in oneDNN's layout for `linear`: a new opaque tensor, the weight untouched."""
    if not supports(weight):
        features = cpu.detected()
        packable = [str(d).removeprefix("torch.") for d in PACKING_NEEDS if PACKING_NEEDS[d] <= features]
        raise ValueError(
            f"cannot prepack a {weight.dtype} weight of shape {tuple(weight.shape)} on {weight.device}: "
            "expected a 2-d CPU tensor of a dtype this CPU and torch build pack: "
            f"{', '.join(packable) or 'none'}"
        )
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_BATCH_HINT)
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for x [..., in], with `packed` = `pack(weight)`; not differentiable."""
    rows = x.reshape(-1, x.shape[-1])
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


class _TrainableLinear(torch.autograd.Function):
    """Forward packed (the values an inference engine computes), backward through plain matmuls."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear(x, pack(weight), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_weight = flat_grad.t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_bias = flat_grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias


def trainable_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear` with gradients for x, weight and bias; packs `weight` on every call."""
    out: torch.Tensor = _TrainableLinear.apply(x, weight, bias)  # type: ignore[no-untyped-call]
    return out


class PackedWeight:
    """An inference layer's packed copy of its weight (or of several weights stacked along their outputs,
    for projections of the same input computed in one call), rebuilt when a weight is another tensor or
    was written in place (its version moved; fused optimizer kernels write without moving it, which is why
    training packs on every call instead). Copies and pickles start empty: oneDNN's opaque tensors can be
    neither."""

    __slots__ = ("_key", "_packed")

    def __init__(self) -> None:
        self._packed: torch.Tensor | None = None
        self._key: tuple[tuple[int, int], ...] = ()

    def get(self, *weights: torch.Tensor) -> torch.Tensor:
        key = tuple((w.data_ptr(), -1 if w.is_inference() else w._version) for w in weights)
        packed = self._packed
        if packed is None or key != self._key:
            packed = pack(weights[0] if len(weights) == 1 else torch.cat([w.detach() for w in weights]))
            self._packed, self._key = packed, key
        return packed

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedWeight:
        return PackedWeight()

    def __reduce__(self) -> tuple[type[PackedWeight], tuple[()]]:
        return (PackedWeight, ())
