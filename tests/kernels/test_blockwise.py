"""Block-wise (online-softmax) attention over the paged cache against SDPA on the same keys: chunk
offsets, grouped heads, sliding windows, lengths that are not multiples of the tile; and its memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from tether.kernels.blockwise import LongChunkAttention, blockwise_attention, full_attention

BLOCK_SIZE = 4


def paged_problem(
    seed: int, context: int, queries: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q for the last `queries` positions of a `context`-token sequence whose K/V fill scattered blocks."""
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-context // BLOCK_SIZE)
    shape = (blocks + 3, BLOCK_SIZE, kv_heads, head_dim)
    keys = torch.randn(shape, generator=generator).to(dtype)
    values = torch.randn(shape, generator=generator).to(dtype)
    table = torch.randperm(blocks + 3, generator=generator)[:blocks]
    q = torch.randn((queries, heads, head_dim), generator=generator).to(dtype)
    return q, keys, values, table


def sdpa_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    context: int,
    window: int | None,
) -> torch.Tensor:
    """SDPA in float64 over the whole gathered context, with an explicit causal (and window) mask."""
    tokens, _, head_dim = q.shape
    k = keys[table].flatten(0, 1)[:context].double()
    v = values[table].flatten(0, 1)[:context].double()
    query_pos = torch.arange(context - tokens, context)[:, None]
    key_pos = torch.arange(context)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=head_dim**-0.5,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def run_path(
    path: str,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    context: int,
    window: int | None,
    block_tokens: int = 8,
) -> torch.Tensor:
    """One of the two long-chunk paths over the table from the block its window's first key is in."""
    start = context - q.shape[0]
    first = 0 if window is None else max(0, start - window + 1) // BLOCK_SIZE
    sliced = table[first:]
    scale = q.shape[-1] ** -0.5
    if path == "full":
        return full_attention(q, keys, values, sliced, first * BLOCK_SIZE, start, window, scale)
    return blockwise_attention(
        q, keys, values, sliced, first * BLOCK_SIZE, start, window, scale, block_tokens
    )


@pytest.mark.parametrize("path", ["blockwise", "full"])
@pytest.mark.parametrize(
    ("context", "queries", "heads", "kv_heads", "window"),
    [
        (37, 37, 4, 2, None),  # a whole prompt, odd length
        (53, 11, 4, 2, None),  # a chunk after 42 cached tokens
        (64, 16, 6, 6, None),  # no grouping, tile-aligned
        (61, 29, 8, 2, 10),  # a window shorter than a tile
        (90, 45, 4, 1, 24),  # a window over several tiles, one KV head
        (23, 7, 4, 2, 100),  # a window longer than the context
        (33, 1, 4, 2, 5),  # a single query
    ],
)
def test_long_chunk_paths_equal_sdpa(
    path: str, context: int, queries: int, heads: int, kv_heads: int, window: int | None
) -> None:
    q, keys, values, table = paged_problem(0, context, queries, heads, kv_heads, 16, torch.float32)
    ours = run_path(path, q, keys, values, table, context, window)
    reference = sdpa_reference(q, keys, values, table, context, window)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-5)


def test_blockwise_in_bfloat16_stays_close_to_float32() -> None:
    q, keys, values, table = paged_problem(1, 70, 30, 4, 2, 16, torch.float32)
    low = run_path("blockwise", q.bfloat16(), keys.bfloat16(), values.bfloat16(), table, 70, 24)
    assert low.dtype == torch.bfloat16
    reference = sdpa_reference(q, keys, values, table, 70, 24)
    torch.testing.assert_close(low.double(), reference, rtol=0.05, atol=0.05)


def test_blockwise_never_reads_blocks_before_the_window() -> None:
    q, keys, values, table = paged_problem(2, 80, 8, 4, 2, 16, torch.float32)
    reference = run_path("blockwise", q, keys, values, table, 80, 12)
    poisoned_keys, poisoned_values = keys.clone(), values.clone()
    first_needed = (80 - 8 - 12 + 1) // BLOCK_SIZE
    poisoned_keys[table[:first_needed]] = torch.nan
    poisoned_values[table[:first_needed]] = torch.nan
    again = run_path("blockwise", q, poisoned_keys, poisoned_values, table, 80, 12)
    assert torch.equal(again, reference)


@pytest.mark.parametrize("block_tokens", [0, 6, -4])
def test_blockwise_refuses_tiles_that_are_not_whole_blocks(block_tokens: int) -> None:
    q, keys, values, table = paged_problem(3, 16, 4, 2, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=f"block_tokens = {block_tokens}"):
        blockwise_attention(q, keys, values, table, 0, 12, None, 1.0, block_tokens)


def largest_allocation_bytes(path: str, context: int) -> int:
    """The largest single CPU allocation one long-chunk path makes for a 32-query chunk at `context`
    (from torch's profiler)."""
    q, keys, values, table = paged_problem(4, context, 32, 4, 2, 16, torch.float32)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        run_path(path, q, keys, values, table, context, None, block_tokens=64)
    return int(max(event.cpu_memory_usage for event in recorded.events() if event.cpu_memory_usage > 0))


def test_blockwise_memory_does_not_grow_with_the_context() -> None:
    """The same 32-query chunk at a short and at an 8x longer context: block-wise attention's largest
    intermediate stays the same, the full score matrix's grows with the context."""
    sizes = {
        (path, n): largest_allocation_bytes(path, n) for path in ("blockwise", "full") for n in (512, 4096)
    }
    assert sizes["blockwise", 4096] == sizes["blockwise", 512]
    assert sizes["full", 4096] >= 6 * sizes["full", 512]
    assert sizes["blockwise", 4096] * 8 <= sizes["full", 4096]


def test_the_policy_takes_long_contexts_only_and_zero_means_the_full_matrix() -> None:
    q, keys, values, table = paged_problem(5, 40, 10, 4, 2, 16, torch.float32)
    policy = LongChunkAttention(block_tokens=0, min_context=40)
    assert policy.takes(40) and not policy.takes(39)
    full = policy.attend(q, keys, values, table, 0, 30, None, 0.25)
    assert torch.equal(full, full_attention(q, keys, values, table, 0, 30, None, 0.25))
    tiled = LongChunkAttention(block_tokens=8, min_context=1).attend(
        q, keys, values, table, 0, 30, None, 0.25
    )
    torch.testing.assert_close(tiled, full, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_on_cuda_equals_sdpa(dtype: torch.dtype) -> None:
    q, keys, values, table = paged_problem(6, 300, 100, 8, 2, 64, torch.float32)
    cuda_q, cuda_keys, cuda_values = (t.to(dtype).cuda() for t in (q, keys, values))
    ours = run_path("blockwise", cuda_q, cuda_keys, cuda_values, table.cuda(), 300, 40, block_tokens=32)
    assert ours.device.type == "cuda" and ours.dtype == dtype
    reference = sdpa_reference(q, keys, values, table, 300, 40)
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(ours.cpu().double(), reference, rtol=tolerance, atol=tolerance)
