"""The dynamic int8 matmul: every path this CPU has gives the portable path's bits and matches the torch
reference within its tolerance on odd shapes, rows do not depend on the rows sharing the call, the
activations round to int8 in blocks of 32, and bad inputs are refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from tether.kernels import w8a8_gemm
from tether.kernels.cpu import CpuFeature
from tether.kernels.w8a8_gemm import TOLERANCE, W8A8Kernel

PATHS = [
    pytest.param(kernel, marks=pytest.mark.skipif(not w8a8_gemm.available(kernel), reason="CPU lacks it"))
    for kernel in W8A8Kernel
]
# (rows, outputs, inputs): N not a multiple of a panel, one row, a row tile and one past, several blocks.
SHAPES = [(1, 33, 32), (33, 100, 576), (5, 32, 64), (7, 65, 96), (2, 1, 32), (13, 160, 160)]


def quantized(outputs: int, inputs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (outputs, inputs), dtype=torch.int8, generator=generator)
    scale = torch.rand(outputs, generator=generator) * 0.01 + 1e-4
    bias = torch.randn(outputs, generator=generator)
    return q, scale, bias


@pytest.mark.parametrize(
    ("features", "expected"),
    [
        (set(CpuFeature), W8A8Kernel.VNNI),
        ({CpuFeature.AVX2_FMA, CpuFeature.AVX512F}, W8A8Kernel.AVX2),
        ({CpuFeature.ONEDNN}, W8A8Kernel.PORTABLE),
        (set(), W8A8Kernel.PORTABLE),
    ],
)
def test_the_path_follows_the_cpu_features(features: set[CpuFeature], expected: W8A8Kernel) -> None:
    assert w8a8_gemm.w8a8_kernel(frozenset(features)) is expected


@pytest.mark.parametrize("kernel", PATHS)
@pytest.mark.parametrize(("rows", "outputs", "inputs"), SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_every_path_gives_the_portable_bits_within_tolerance_of_the_reference(
    kernel: W8A8Kernel, rows: int, outputs: int, inputs: int, with_bias: bool
) -> None:
    q, scale, bias = quantized(outputs, inputs, seed=rows * 1000 + inputs)
    kept = bias if with_bias else None
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(outputs)) * 3
    packed = w8a8_gemm.pack(q, scale, kept)
    out = w8a8_gemm.linear(x, packed, kernel)
    assert out.shape == (rows, outputs) and out.dtype == torch.float32
    assert torch.equal(out, w8a8_gemm.linear(x, packed, W8A8Kernel.PORTABLE))
    expected = w8a8_gemm.reference(x.double(), q, scale, kept)
    magnitude = x.double().abs() @ (q.double().abs() * scale.double()[:, None]).T
    assert ((out.double() - expected).abs() <= TOLERANCE * (magnitude + 1)).all()


@pytest.mark.parametrize("kernel", PATHS)
def test_a_row_does_not_depend_on_the_rows_sharing_the_call(kernel: W8A8Kernel) -> None:
    q, scale, bias = quantized(70, 128, seed=5)
    packed = w8a8_gemm.pack(q, scale, bias)
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(6))
    whole = w8a8_gemm.linear(x, packed, kernel)
    for start, stop in ((0, 1), (3, 10), (31, 32), (5, 29)):
        assert torch.equal(w8a8_gemm.linear(x[start:stop], packed, kernel), whole[start:stop])


def edge_rows() -> torch.Tensor:
    """Rows whose blocks of 32 hold rounding ties, zeros, subnormals, extremes and negative maxima."""
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(7))
    x[0, :32] = torch.tensor([127.0] + [k + 0.5 for k in range(-15, 16)])  # scale 1: every other value a tie
    x[1] = 0.0
    x[2, :32] = 1e-40  # subnormal: a positive scale all the same
    x[3, 32:64] = torch.linspace(-1.0, 0.7, 32) * 3e38
    x[4, 64:] = -x[4, 64:].abs() * 1e6
    x[5, :32] = torch.tensor([-2.54] + [0.01 * k for k in range(31)])  # exact halves of the 0.02 step
    return x


@pytest.mark.parametrize("kernel", PATHS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_path_quantizes_ties_zeros_and_extremes_as_the_reference_on_any_thread_count(
    kernel: W8A8Kernel, threads: int
) -> None:
    """With an identity weight the kernel returns its quantized rows: each path, its rows split over any
    number of threads, gives the reference's rounding bit for bit."""
    x = edge_rows()
    identity = w8a8_gemm.pack(torch.eye(96, dtype=torch.int8), torch.ones(96))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = w8a8_gemm.linear(x, identity, kernel)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, w8a8_gemm.quantize_rows(x))


def test_activations_round_to_int8_in_blocks_of_32() -> None:
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-2.54, 1.27, 32)  # largest |x| 2.54: the step is 0.02
    x[0, 32] = 0.5  # a block of its own: its one value is its own largest
    rounded = w8a8_gemm.quantize_rows(x)
    torch.testing.assert_close(rounded[0, :32], torch.round(x[0, :32] / 0.02) * 0.02)
    assert rounded[0, 0] == x[0, 0] and rounded[0, 32] == 0.5
    assert torch.equal(rounded[1], torch.zeros(64))  # an all-zero block stays zero, no division by zero


def test_a_quantized_model_differs_from_weight_only_int8_by_the_rounded_activations() -> None:
    q, scale, _ = quantized(16, 64, seed=7)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(8))
    weight_only = x @ (q.float() * scale[:, None]).T
    out = w8a8_gemm.linear(x, w8a8_gemm.pack(q, scale))
    assert not torch.allclose(out, weight_only, rtol=0, atol=1e-6)
    torch.testing.assert_close(out, w8a8_gemm.quantize_rows(x) @ (q.float() * scale[:, None]).T)


@pytest.mark.parametrize(
    ("qweight", "message"),
    [
        (torch.zeros(4, 48, dtype=torch.int8), "multiple of 32"),
        (torch.zeros(4, 32), "int8"),
        (torch.zeros(0, 32, dtype=torch.int8), "multiple of 32"),
    ],
)
def test_bad_weights_are_refused(qweight: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        w8a8_gemm.pack(qweight, torch.ones(qweight.shape[0]))


def test_rows_of_the_wrong_width_are_refused() -> None:
    packed = w8a8_gemm.pack(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4))
    with pytest.raises(ValueError, match="rows of 32 features"):
        w8a8_gemm.linear(torch.zeros(2, 64), packed)
