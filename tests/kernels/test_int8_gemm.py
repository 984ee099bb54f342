"""The weight-only int8 matmul: every path this CPU has matches the dequantize-then-float matmul within
its tolerance on odd shapes, the vector paths agree bit for bit, rows do not depend on the rows sharing
the call, stacking changes no value, and bad inputs are refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from tether.kernels import _int8mm, int8_gemm
from tether.kernels.cpu import CpuFeature
from tether.kernels.int8_gemm import TOLERANCE, Int8Kernel

PATHS = [
    pytest.param(kernel, marks=pytest.mark.skipif(not int8_gemm.available(kernel), reason="CPU lacks it"))
    for kernel in Int8Kernel
]
# (rows, outputs, inputs): K and N not multiples of any vector width, one row, a row tile and a panel past.
SHAPES = [(1, 33, 7), (33, 100, 577), (5, 32, 1), (12, 64, 16), (13, 65, 19), (2, 1, 3), (3, 160, 40)]


def quantized(outputs: int, inputs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (outputs, inputs), dtype=torch.int8, generator=generator)
    scale = torch.rand(outputs, generator=generator) * 0.01 + 1e-4
    bias = torch.randn(outputs, generator=generator)
    return q, scale, bias


def dequantized_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    out = x.double() @ (q.double() * scale.double()[:, None]).T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize(
    ("features", "expected"),
    [
        (set(CpuFeature), Int8Kernel.AVX512),
        ({CpuFeature.AVX2_FMA, CpuFeature.ONEDNN}, Int8Kernel.AVX2),
        ({CpuFeature.ONEDNN}, Int8Kernel.PORTABLE),
        (set(), Int8Kernel.PORTABLE),
    ],
)
def test_the_path_follows_the_cpu_features(features: set[CpuFeature], expected: Int8Kernel) -> None:
    assert int8_gemm.int8_kernel(frozenset(features)) is expected


def test_the_portable_path_runs_on_every_cpu() -> None:
    assert int8_gemm.available(Int8Kernel.PORTABLE)


@pytest.mark.parametrize("kernel", PATHS)
@pytest.mark.parametrize(("rows", "outputs", "inputs"), SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_every_path_matches_the_dequantized_float_matmul(
    kernel: Int8Kernel, rows: int, outputs: int, inputs: int, with_bias: bool
) -> None:
    q, scale, bias = quantized(outputs, inputs, seed=rows * 1000 + inputs)
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(outputs))
    packed = int8_gemm.pack(q, scale, bias if with_bias else None)
    out = int8_gemm.linear(x, packed, kernel)
    expected = dequantized_matmul(x, q, scale, bias if with_bias else None)
    magnitude = x.double().abs() @ (q.double().abs() * scale.double()[:, None]).T
    assert out.shape == (rows, outputs) and out.dtype == torch.float32
    assert ((out.double() - expected).abs() <= TOLERANCE * (magnitude + 1)).all()


def test_the_vector_paths_agree_bit_for_bit_and_rows_do_not_depend_on_their_neighbours() -> None:
    vector = [k for k in (Int8Kernel.AVX512, Int8Kernel.AVX2) if int8_gemm.available(k)]
    if not vector:
        pytest.skip("CPU without AVX2")
    q, scale, bias = quantized(200, 131, seed=3)
    packed = int8_gemm.pack(q, scale, bias)
    x = torch.randn(33, 131, generator=torch.Generator().manual_seed(4))
    results = [int8_gemm.linear(x, packed, kernel) for kernel in vector]
    for other in results[1:]:
        assert torch.equal(results[0], other)
    for kernel in vector:
        one_at_a_time = torch.cat([int8_gemm.linear(x[i : i + 1], packed, kernel) for i in range(33)])
        assert torch.equal(one_at_a_time, results[0])


def test_threads_change_no_bit() -> None:
    q, scale, bias = quantized(320, 64, seed=5)
    packed = int8_gemm.pack(q, scale, bias)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = int8_gemm.linear(x, packed)
        torch.set_num_threads(2)
        assert torch.equal(int8_gemm.linear(x, packed), single)
    finally:
        torch.set_num_threads(threads)


def test_stacked_weights_give_each_part_its_own_values() -> None:
    parts = [quantized(outputs, 48, seed=outputs) for outputs in (40, 8, 33)]
    x = torch.randn(3, 2, 48, generator=torch.Generator().manual_seed(7))
    stacked = int8_gemm.stack([int8_gemm.pack(*part) for part in parts])
    split = torch.split(int8_gemm.linear(x, stacked), [40, 8, 33], dim=-1)
    assert stacked.out_features == 81 and split[0].shape == (3, 2, 40)
    for values, part in zip(split, parts, strict=True):
        assert torch.equal(values, int8_gemm.linear(x, int8_gemm.pack(*part)))


def test_no_rows_give_an_empty_result() -> None:
    q, scale, _ = quantized(10, 6, seed=8)
    out = int8_gemm.linear(torch.zeros(0, 6), int8_gemm.pack(q, scale))
    assert out.shape == (0, 10)


def test_bad_weights_are_refused_with_their_shape() -> None:
    q, scale, _ = quantized(10, 6, seed=9)
    with pytest.raises(ValueError, match=r"expected a 2-d int8 CPU weight, got torch.float32"):
        int8_gemm.pack(q.float(), scale)
    with pytest.raises(ValueError, match=r"scale of shape \(9,\) does not fit 10 outputs"):
        int8_gemm.pack(q, scale[:9])
    with pytest.raises(ValueError, match="cannot pack an empty weight"):
        int8_gemm.pack(q[:, :0], scale)
    with pytest.raises(ValueError, match="must all have a bias or none"):
        int8_gemm.stack([int8_gemm.pack(q, scale), int8_gemm.pack(q, scale, scale)])


def test_bad_rows_are_refused_with_what_was_expected() -> None:
    q, scale, _ = quantized(10, 6, seed=10)
    packed = int8_gemm.pack(q, scale)
    with pytest.raises(ValueError, match=r"rows of 6 features .* got torch.float32 of shape \(2, 5\)"):
        int8_gemm.linear(torch.zeros(2, 5), packed)
    with pytest.raises(ValueError, match=r"got torch.float64"):
        int8_gemm.linear(torch.zeros(2, 6, dtype=torch.float64), packed)


def test_a_path_the_cpu_lacks_is_refused_not_run() -> None:
    q, scale, _ = quantized(4, 4, seed=11)
    packed = int8_gemm.pack(q, scale)
    x, out = torch.zeros(1, 4), torch.zeros(1, 4)
    pointers = (x.data_ptr(), packed.panels.data_ptr(), packed.scale.data_ptr(), 0, out.data_ptr())
    assert not _int8mm.supports(7)
    with pytest.raises(ValueError, match="this CPU cannot take path 7; use the portable path"):
        _int8mm.matmul(*pointers, 1, 4, 4, 1, 7)
