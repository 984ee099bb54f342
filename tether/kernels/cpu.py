"""What this CPU and this torch build can run: the features the CPU-specific kernels depend on, read once.

Each kernel's choice is a pure function of a feature set (`prepack.projection_kernel`,
`tether.kernels.attention.attention_kernel`), so every fallback can be tested on a machine that has the
feature: pass a set without it. This module only detects; it chooses nothing and changes no setting.
"""

from __future__ import annotations

import functools
from enum import Enum

import torch

# Read by /proc alone, so they live below every subsystem; re-exported for the kernels' callers.
from tether.machine import CPU_INFO as CPU_INFO
from tether.machine import cpu_flags as cpu_flags
from tether.machine import cpu_model as cpu_model


class CpuFeature(Enum):
    AVX2_FMA = "avx2+fma"
    F16C = "f16c"
    AVX512F = "avx512f"
    AVX512_VNNI = "avx512f+avx512_vnni"
    ONEDNN = "onednn"
    ONEDNN_BF16 = "onednn-bf16"


# What each feature is, and which kernel path needs it.
USES = {
    CpuFeature.AVX2_FMA: "AVX2 and FMA instructions: the decode attention kernel's vector path",
    CpuFeature.F16C: "float16 conversions: that vector path over a float16 KV cache",
    CpuFeature.AVX512F: "AVX-512 foundation instructions: the int8 weight matmul's widest path",
    CpuFeature.AVX512_VNNI: "AVX-512 VNNI byte dot products: the dynamic int8 matmul's widest path",
    CpuFeature.ONEDNN: "torch built with oneDNN: prepacked float32 projections",
    CpuFeature.ONEDNN_BF16: "oneDNN's bfloat16 kernels (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): "
    "prepacked bfloat16 projections",
}


def features_of(flags: frozenset[str], onednn: bool, onednn_bf16: bool) -> frozenset[CpuFeature]:
    """The features from the CPU's flags and what torch reports for its oneDNN build."""
    found = set()
    if {"avx2", "fma"} <= flags:
        found.add(CpuFeature.AVX2_FMA)
    if "f16c" in flags:
        found.add(CpuFeature.F16C)
    if "avx512f" in flags:
        found.add(CpuFeature.AVX512F)
        if "avx512_vnni" in flags:
            found.add(CpuFeature.AVX512_VNNI)
    if onednn:
        found.add(CpuFeature.ONEDNN)
        if onednn_bf16:
            found.add(CpuFeature.ONEDNN_BF16)
    return frozenset(found)


@functools.cache
def detected() -> frozenset[CpuFeature]:
    """This machine's features, read once per process (a CPU does not change under a running process)."""
    try:
        flags = cpu_flags(CPU_INFO.read_text())
    except OSError:  # no /proc: the vector path is then left out, the portable one always works
        flags = frozenset()
    onednn = (
        bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )
    bf16 = (
        onednn
        and hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )
    return features_of(flags, onednn, bf16)
