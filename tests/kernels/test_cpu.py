"""CPU feature detection: /proc/cpuinfo's flags and torch's oneDNN checks become the features the kernel
choices read, for an AVX-512 CPU, an AVX2-only AMD EPYC and a CPU with neither."""

from __future__ import annotations

import pytest
import torch

from tether.kernels import cpu
from tether.kernels.cpu import CpuFeature, cpu_flags, features_of

# Excerpts of /proc/cpuinfo: an AVX2-only AMD EPYC (where bfloat16 packing failed) and an AVX-512 Xeon.
EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2
"""
XEON_AVX512 = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 fma avx avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 amx_tile
"""
EPYC_VNNI = "processor\t: 0\nflags\t\t: fpu fma avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"
OLD_X86 = "processor\t: 0\nflags\t\t: fpu sse sse2 sse4_2 avx\n"


@pytest.mark.parametrize(
    ("cpuinfo", "onednn_bf16", "expected"),
    [
        (EPYC_AVX2, False, {CpuFeature.AVX2_FMA, CpuFeature.F16C, CpuFeature.ONEDNN}),
        (
            XEON_AVX512,
            True,
            {CpuFeature.AVX2_FMA, CpuFeature.AVX512F, CpuFeature.ONEDNN, CpuFeature.ONEDNN_BF16},
        ),
        (
            EPYC_VNNI,
            False,
            {CpuFeature.AVX2_FMA, CpuFeature.AVX512F, CpuFeature.AVX512_VNNI, CpuFeature.ONEDNN},
        ),
        (OLD_X86, False, {CpuFeature.ONEDNN}),
        ("", False, {CpuFeature.ONEDNN}),
    ],
    ids=["epyc-avx2", "xeon-avx512", "epyc-vnni", "no-avx2", "no-cpuinfo"],
)
def test_features_follow_the_flags_and_torchs_checks(
    cpuinfo: str, onednn_bf16: bool, expected: set[CpuFeature]
) -> None:
    assert features_of(cpu_flags(cpuinfo), onednn=True, onednn_bf16=onednn_bf16) == expected


def test_without_onednn_no_onednn_feature_is_claimed() -> None:
    assert features_of(cpu_flags(XEON_AVX512), onednn=False, onednn_bf16=True) == {
        CpuFeature.AVX2_FMA,
        CpuFeature.AVX512F,
    }


def test_detection_agrees_with_torchs_own_bf16_check() -> None:
    supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert (CpuFeature.ONEDNN_BF16 in cpu.detected()) == supported
