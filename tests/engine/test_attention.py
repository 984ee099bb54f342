"""Decode attention over the paged cache: the C kernel against the torch path, and its bounds checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tether.engine.attention import (
    AttentionMetadata,
    SequenceSpan,
    decode_native,
    decode_torch,
    native_decode_applies,
)


def random_decode_problem(
    seed: int, lengths: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int
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
    metadata = AttentionMetadata.build(spans, torch.zeros(len(lengths), dtype=torch.long), block_size)
    return q, keys, values, metadata


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    # head_dim 64, 128 and 24 take the AVX2 path where the CPU has it, 36 and 20 plain C
    [(9, 3, 64, 16), (4, 4, 36, 4), (8, 2, 128, 8), (6, 1, 20, 3)],
)
def test_native_decode_matches_torch(heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    lengths = [1, 7, 33, 64, 129, 5, 300]
    q, keys, values, metadata = random_decode_problem(0, lengths, heads, kv_heads, head_dim, block_size)
    assert metadata.decode is not None
    assert native_decode_applies(q, keys, values)
    native, reference = torch.full_like(q, torch.nan), torch.full_like(q, torch.nan)
    decode_native(q, keys, values, metadata.decode, kv_heads, head_dim**-0.5, native)
    decode_torch(q, keys, values, metadata.decode, kv_heads, head_dim**-0.5, reference)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 20])
def test_native_decode_gives_the_same_bits_on_any_thread_count(head_dim: int) -> None:
    """Work is split by (sequence, KV head); each is computed whole by one thread."""
    q, keys, values, metadata = random_decode_problem(1, [3, 90, 17, 200, 41], 6, 2, head_dim, 16)
    assert metadata.decode is not None
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            out = torch.full_like(q, torch.nan)
            decode_native(q, keys, values, metadata.decode, 2, head_dim**-0.5, out)
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
    assert metadata.decode is not None
    before = torch.empty_like(q)
    decode_native(q, keys, values, metadata.decode, 2, 0.25, before)
    tables = metadata.decode.tables
    keys[tables[0, 0], 3:] = 1e6  # slots past the first sequence's 3 tokens, in its own block
    after = torch.empty_like(q)
    decode_native(q, keys, values, metadata.decode, 2, 0.25, after)
    torch.testing.assert_close(before, after, rtol=0, atol=0)


def test_native_decode_rejects_a_block_id_outside_the_cache() -> None:
    q, keys, values, metadata = random_decode_problem(2, [10, 10], 2, 1, 8, 4)
    assert metadata.decode is not None
    metadata.decode.tables[1, 1] = keys.shape[0] + 3
    with pytest.raises(ValueError, match="block id or length is out of range"):
        decode_native(q, keys, values, metadata.decode, 1, 1.0, torch.empty_like(q))


def test_native_decode_does_not_apply_to_other_dtypes_or_layouts() -> None:
    q, keys, values, _ = random_decode_problem(3, [4], 2, 1, 8, 4)
    assert not native_decode_applies(q.double(), keys.double(), values.double())
    assert not native_decode_applies(q, keys.transpose(0, 1), values)
