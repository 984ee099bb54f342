"""Decode attention over the paged cache: the C kernel's AVX2 and portable paths against the torch path,
which path each CPU takes, and the kernel's bounds checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tether.kernels import _paged, cpu
from tether.kernels.attention import (
    AttentionKernel,
    AttentionMetadata,
    DecodeGroup,
    SequenceSpan,
    attention_kernel,
    decode_native,
    decode_torch,
    kernel_for,
    native_attention,
)
from tether.kernels.cpu import CpuFeature

# The portable path runs on every CPU; the AVX2 one only where the CPU has it (skipped elsewhere).
NEEDS_AVX2 = pytest.mark.skipif(CpuFeature.AVX2_FMA not in cpu.detected(), reason="CPU without AVX2/FMA")
NATIVE_PATHS = [AttentionKernel.C_PORTABLE, pytest.param(AttentionKernel.C_AVX2, marks=NEEDS_AVX2)]


def random_decode_problem(
    seed: int,
    lengths: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 5
    order = torch.randperm(num_blocks, generator=generator).tolist()  # scattered, non-contiguous tables
    spans = []
    for row, length in enumerate(lengths):
        table = [order.pop() for _ in range(-(-length // block_size))]
        spans.append(SequenceSpan(query_start=row, query_len=1, start=length - 1, block_table=table))
    shape = (num_blocks, block_size, kv_heads, head_dim)
    keys = torch.randn(shape, generator=generator)
    values = torch.randn(shape, generator=generator)
    q = torch.randn((len(lengths), heads, head_dim), generator=generator)
    slots = torch.zeros(len(lengths), dtype=torch.long)
    metadata = AttentionMetadata.build(spans, slots, block_size, windows=(None, window))
    return q, keys, values, metadata


def decoded(metadata: AttentionMetadata, window: int | None = None) -> DecodeGroup:
    group = metadata.view(window).decode
    assert group is not None
    return group


SHAPES = [(9, 3, 64, 16), (8, 2, 128, 8), (4, 4, 24, 4), (6, 1, 20, 3), (4, 4, 36, 4)]


@pytest.mark.parametrize("kernel", NATIVE_PATHS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_native_decode_matches_torch(
    kernel: AttentionKernel, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    if kernel is AttentionKernel.C_AVX2 and head_dim % 8:
        pytest.skip("the AVX2 path takes head_dim multiples of 8")
    lengths = [1, 7, 33, 64, 129, 5, 300]
    q, keys, values, metadata = random_decode_problem(0, lengths, heads, kv_heads, head_dim, block_size)
    assert kernel_for(q, keys, values) is not AttentionKernel.TORCH_SDPA
    native, reference = torch.full_like(q, torch.nan), torch.full_like(q, torch.nan)
    decode_native(q, keys, values, decoded(metadata), kv_heads, head_dim**-0.5, native, kernel)
    decode_torch(q, keys, values, decoded(metadata), kv_heads, head_dim**-0.5, reference)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)


# The AVX2 path over a float16 cache also needs F16C (every AVX2 CPU has it; the check is kept).
NEEDS_F16C = pytest.mark.skipif(
    not {CpuFeature.AVX2_FMA, CpuFeature.F16C} <= cpu.detected(), reason="CPU without AVX2/FMA/F16C"
)
HALF_PATHS = [AttentionKernel.C_PORTABLE, pytest.param(AttentionKernel.C_AVX2, marks=NEEDS_F16C)]


@pytest.mark.parametrize("kernel", HALF_PATHS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_native_decode_over_a_float16_cache_is_the_float32_attention_of_its_values(
    kernel: AttentionKernel, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    """float16 converts to float32 exactly, so the kernel over a float16 cache attends to the same numbers
    as over that cache upcast: special values (subnormals, signed zero, the largest half) included."""
    if kernel is AttentionKernel.C_AVX2 and head_dim % 8:
        pytest.skip("the AVX2 path takes head_dim multiples of 8")
    lengths = [1, 7, 33, 64, 129, 5, 300]
    q, keys, values, metadata = random_decode_problem(6, lengths, heads, kv_heads, head_dim, block_size)
    keys, values = keys.half(), values.half()
    specials = torch.tensor([6e-8, -6e-8, 3e-5, -0.0, 0.0, 65504.0, -65504.0], dtype=torch.float16)
    values.view(-1)[: specials.numel()] = specials
    keys.view(-1)[: specials.numel() - 2] = specials[:-2]  # the largest half as a key would overflow exp
    assert kernel_for(q, keys, values) is not AttentionKernel.TORCH_SDPA
    native, reference = torch.full_like(q, torch.nan), torch.full_like(q, torch.nan)
    decode_native(q, keys, values, decoded(metadata), kv_heads, head_dim**-0.5, native, kernel)
    decode_torch(q, keys.float(), values.float(), decoded(metadata), kv_heads, head_dim**-0.5, reference)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", HALF_PATHS)
def test_prefill_rows_over_a_float16_cache_match_their_float32_values(kernel: AttentionKernel) -> None:
    q, keys, values, metadata = random_decode_problem(7, [40, 90], 6, 2, 16, 8)
    group = decoded(metadata)
    half = native_attention(q, keys.half(), values.half(), group.tables, group.lengths, 0.25, kernel)
    upcast = native_attention(
        q, keys.half().float(), values.half().float(), group.tables, group.lengths, 0.25, kernel
    )
    assert torch.equal(half, upcast)


@pytest.mark.parametrize("kernel", NATIVE_PATHS)
@pytest.mark.parametrize("first", [0, 3])
def test_decode_rows_in_one_range_are_attended_in_place_with_the_gathered_bits(
    kernel: AttentionKernel, first: int
) -> None:
    """Decode rows that are one range of the batch (here after `first` rows of a prefill) are read and
    written in place; rows out of order take the gather. Both give the bits of the one-by-one call."""
    lengths = [5, 40, 17, 3]
    q, keys, values, metadata = random_decode_problem(1, lengths, 6, 2, 32, 8)
    group = decoded(metadata)
    assert group.first_row == 0
    shifted = DecodeGroup(
        group.rows + first, first, group.tables, group.lengths, group.starts, group.mask, group.longest
    )
    batch = torch.cat([torch.randn(first, 6, 32), q])
    in_place = torch.full_like(batch, torch.nan)
    decode_native(batch, keys, values, shifted, 2, 32**-0.5, in_place, kernel)
    assert in_place[:first].isnan().all() and not in_place[first:].isnan().any()
    order = torch.tensor([2, 0, 3, 1])  # the same sequences, their rows scattered
    scattered = DecodeGroup(order, None, group.tables, group.lengths, group.starts, group.mask, group.longest)
    gathered = torch.full_like(q, torch.nan)
    decode_native(q[torch.argsort(order)], keys, values, scattered, 2, 32**-0.5, gathered, kernel)
    assert torch.equal(in_place[first:], gathered[order])
    for row in range(len(lengths)):
        alone = torch.full_like(q[:1], torch.nan)
        one = DecodeGroup(
            torch.tensor([0]),
            0,
            group.tables[row : row + 1],
            group.lengths[row : row + 1],
            group.starts[row : row + 1],
            group.mask[row : row + 1],
            int(group.lengths[row]),
        )
        decode_native(q[row : row + 1], keys, values, one, 2, 32**-0.5, alone, kernel)
        assert torch.equal(alone[0], in_place[first + row])


@pytest.mark.parametrize(
    ("features", "dtype", "head_dim", "kernel"),
    [
        ({CpuFeature.AVX2_FMA}, torch.float32, 64, AttentionKernel.C_AVX2),
        ({CpuFeature.AVX2_FMA, CpuFeature.ONEDNN}, torch.float32, 128, AttentionKernel.C_AVX2),
        ({CpuFeature.AVX2_FMA}, torch.float32, 20, AttentionKernel.C_PORTABLE),
        (set(), torch.float32, 64, AttentionKernel.C_PORTABLE),
        ({CpuFeature.ONEDNN, CpuFeature.ONEDNN_BF16}, torch.float32, 64, AttentionKernel.C_PORTABLE),
        (set(CpuFeature), torch.bfloat16, 64, AttentionKernel.TORCH_SDPA),
        (set(), torch.bfloat16, 64, AttentionKernel.TORCH_SDPA),
    ],
)
def test_attention_kernel_follows_the_cpu_features(
    features: set[CpuFeature], dtype: torch.dtype, head_dim: int, kernel: AttentionKernel
) -> None:
    assert attention_kernel(frozenset(features), dtype, head_dim) is kernel


@pytest.mark.parametrize(
    ("features", "cache_dtype", "kernel"),
    [
        ({CpuFeature.AVX2_FMA, CpuFeature.F16C}, torch.float16, AttentionKernel.C_AVX2),
        ({CpuFeature.AVX2_FMA}, torch.float16, AttentionKernel.C_PORTABLE),
        ({CpuFeature.F16C}, torch.float16, AttentionKernel.C_PORTABLE),
        ({CpuFeature.AVX2_FMA}, torch.float32, AttentionKernel.C_AVX2),
        (set(CpuFeature), torch.bfloat16, AttentionKernel.TORCH_SDPA),
    ],
)
def test_float32_queries_take_the_kernel_over_a_float32_or_float16_cache(
    features: set[CpuFeature], cache_dtype: torch.dtype, kernel: AttentionKernel
) -> None:
    assert attention_kernel(frozenset(features), torch.float32, 64, cache_dtype) is kernel


@pytest.mark.parametrize("head_dim", [8, 20, 64])
def test_the_kernel_and_the_detection_agree_on_avx2(head_dim: int) -> None:
    detected = attention_kernel(cpu.detected(), torch.float32, head_dim) is AttentionKernel.C_AVX2
    assert _paged.avx2_fits(head_dim) == detected
    over_half = attention_kernel(cpu.detected(), torch.float32, head_dim, torch.float16)
    assert _paged.avx2_fits(head_dim, True) == (over_half is AttentionKernel.C_AVX2)


@NEEDS_AVX2
def test_portable_and_avx2_paths_agree_closely() -> None:
    q, keys, values, metadata = random_decode_problem(4, [2, 50, 300], 8, 2, 64, 16)
    outs = []
    for kernel in (AttentionKernel.C_PORTABLE, AttentionKernel.C_AVX2):
        out = torch.full_like(q, torch.nan)
        decode_native(q, keys, values, decoded(metadata), 2, 0.125, out, kernel)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


def test_avx2_path_refuses_a_head_dim_it_cannot_take() -> None:
    q, keys, values, metadata = random_decode_problem(5, [9], 2, 1, 20, 4)
    with pytest.raises(ValueError, match=r"AVX2 path needs .* multiple of 8 \(head_dim 20\)"):
        decode_native(q, keys, values, decoded(metadata), 1, 1.0, torch.empty_like(q), AttentionKernel.C_AVX2)


@pytest.mark.parametrize(
    ("head_dim", "kernel"),
    [
        pytest.param(64, AttentionKernel.C_AVX2, marks=NEEDS_AVX2),
        (64, AttentionKernel.C_PORTABLE),
        (20, AttentionKernel.C_PORTABLE),
    ],
)
def test_native_decode_gives_the_same_bits_on_any_thread_count(
    head_dim: int, kernel: AttentionKernel
) -> None:
    """Work is split by (sequence, KV head); each is computed whole by one thread."""
    q, keys, values, metadata = random_decode_problem(1, [3, 90, 17, 200, 41], 6, 2, head_dim, 16)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            out = torch.full_like(q, torch.nan)
            decode_native(q, keys, values, decoded(metadata), 2, head_dim**-0.5, out, kernel)
            results.append(out)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], other) for other in results[1:])


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_the_kernel_shares_torchs_openmp_runtime() -> None:
    """Two OpenMP runtimes would each keep threads spinning for the same cores."""
    runtimes = {
        line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line
    }
    assert len(runtimes) <= 1, f"more than one OpenMP runtime loaded: {sorted(runtimes)}"


def test_native_decode_ignores_stale_cache_beyond_each_length() -> None:
    q, keys, values, metadata = random_decode_problem(1, [3, 20], 4, 2, 16, 8)
    kernel = kernel_for(q, keys, values)
    before = torch.empty_like(q)
    decode_native(q, keys, values, decoded(metadata), 2, 0.25, before, kernel)
    tables = decoded(metadata).tables
    keys[tables[0, 0], 3:] = 1e6  # slots past the first sequence's 3 tokens, in its own block
    after = torch.empty_like(q)
    decode_native(q, keys, values, decoded(metadata), 2, 0.25, after, kernel)
    torch.testing.assert_close(before, after, rtol=0, atol=0)


@pytest.mark.parametrize("kernel", NATIVE_PATHS)
def test_native_decode_rejects_a_block_id_outside_the_cache(kernel: AttentionKernel) -> None:
    q, keys, values, metadata = random_decode_problem(2, [10, 10], 2, 1, 8, 4)
    decoded(metadata).tables[1, 1] = keys.shape[0] + 3
    with pytest.raises(ValueError, match="block id or length is out of range"):
        decode_native(q, keys, values, decoded(metadata), 1, 1.0, torch.empty_like(q), kernel)


def test_native_decode_does_not_apply_to_other_dtypes_or_layouts() -> None:
    q, keys, values, _ = random_decode_problem(3, [4], 2, 1, 8, 4)
    assert kernel_for(q.double(), keys.double(), values.double()) is AttentionKernel.TORCH_SDPA
    assert kernel_for(q.bfloat16(), keys.bfloat16(), values.bfloat16()) is AttentionKernel.TORCH_SDPA
    assert kernel_for(q, keys.transpose(0, 1), values) is AttentionKernel.TORCH_SDPA
    assert kernel_for(q, keys.half(), values) is AttentionKernel.TORCH_SDPA  # caches of two dtypes
    assert kernel_for(q.half(), keys.half(), values.half()) is AttentionKernel.TORCH_SDPA


def windowed_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: list[int], length: int, window: int
) -> torch.Tensor:
    """One decoding token ([heads, d]) over the last `window` of its `length` rows, in float64."""
    k = keys[table].flatten(0, 1)[max(0, length - window) : length].double()
    v = values[table].flatten(0, 1)[max(0, length - window) : length].double()
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    weights = torch.softmax(torch.einsum("hd,thd->ht", q.double(), k) * q.shape[-1] ** -0.5, dim=-1)
    return torch.einsum("ht,thd->hd", weights, v)


@pytest.mark.parametrize("kernel", [*NATIVE_PATHS, AttentionKernel.TORCH_SDPA])
@pytest.mark.parametrize(("head_dim", "block_size", "window"), [(16, 4, 7), (64, 16, 24), (20, 3, 5)])
def test_windowed_decode_sees_only_the_last_window_tokens(
    kernel: AttentionKernel, head_dim: int, block_size: int, window: int
) -> None:
    if kernel is AttentionKernel.C_AVX2 and head_dim % 8:
        pytest.skip("the AVX2 path takes head_dim multiples of 8")
    lengths = [1, 6, 7, 8, 33, 100]
    q, keys, values, metadata = random_decode_problem(6, lengths, 4, 2, head_dim, block_size, window)
    group = decoded(metadata, window)
    out = torch.full_like(q, torch.nan)
    if kernel is AttentionKernel.TORCH_SDPA:
        decode_torch(q, keys, values, group, 2, head_dim**-0.5, out)
    else:
        decode_native(q, keys, values, group, 2, head_dim**-0.5, out, kernel)
    full = decoded(metadata)
    assert full is not None
    for row, length in enumerate(lengths):
        table = full.tables[row, : -(-length // block_size)].tolist()
        expected = windowed_reference(q[row], keys, values, table, length, window)
        torch.testing.assert_close(out[row].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", NATIVE_PATHS)
def test_windowed_decode_never_reads_blocks_before_the_window(kernel: AttentionKernel) -> None:
    """The blocks wholly before a window may be freed (and reused): their contents must not matter, and
    an invalid id there is not an error."""
    q, keys, values, metadata = random_decode_problem(7, [40, 57], 4, 2, 16, 4, window=9)
    group = decoded(metadata, 9)
    assert group.tables.shape[1] <= 4  # only the blocks the window reaches
    before = torch.empty_like(q)
    decode_native(q, keys, values, group, 2, 0.25, before, kernel)
    full = decoded(metadata)
    assert full is not None
    keys[full.tables[0, :7]] = torch.nan  # blocks holding positions 0..27, all before 40 - 9
    values[full.tables[1, :11]] = torch.nan  # positions 0..43, before 57 - 9
    after = torch.empty_like(q)
    decode_native(q, keys, values, group, 2, 0.25, after, kernel)
    assert torch.equal(before, after)


@pytest.mark.parametrize("kernel", NATIVE_PATHS)
def test_native_attention_rejects_a_start_outside_the_rows(kernel: AttentionKernel) -> None:
    q, keys, values, _ = random_decode_problem(8, [10], 2, 1, 8, 4)
    tables = torch.tensor([[0, 1, 2]])
    with pytest.raises(ValueError, match="block id or length is out of range"):
        native_attention(q, keys, values, tables, torch.tensor([10]), 1.0, kernel, starts=torch.tensor([10]))
