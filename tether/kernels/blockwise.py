"""Attention of a long chunk's queries over its paged K/V, tile by tile with an online softmax.

A prefill chunk at a long context otherwise needs either the whole [heads, Q, K] score matrix (SDPA's
math kernel, or `full_attention` here: memory grows with the context) or one query row at a time through
the C kernel (memory-bound: every row reads the whole prefix). `blockwise_attention` walks query tiles and,
for each, the KV tiles of `block_tokens` tokens it can see, reading K/V straight from the cache blocks
(one tile's gather at a time, never the whole context), keeping a running maximum and sum per query row
(FlashAttention's recurrence): the largest intermediate is one [kv_heads, group * tile, tile] score tile,
whatever the context. Causal and sliding-window masks are built only for the tiles the diagonal or the
window's edge crosses; tiles wholly outside the window are not visited. The query heads of a KV head are
folded into the query axis, so grouped-query K/V are never repeated. Plain torch: CPU or CUDA, float32 or
half types (scores, sums and the accumulator in float32).

It is not bit-equal to the C kernel the learner shares with the engine (another summation order), which
is why the engine takes it only for chunks whose context reaches `LongChunkAttention.min_context`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LongChunkAttention:
    """How the engine attends a multi-token chunk whose context is long (`EngineConfig` sets it)."""

    block_tokens: int = 512
    """Query and KV tokens per tile of `blockwise_attention` (a multiple of the cache's block size); 0: the
    chunk's whole [heads, Q, K] score matrix at once (`full_attention`, the baseline)."""
    min_context: int = 4096
    """Chunks whose context (cached and new tokens) reaches this many tokens take this path; shorter ones
    keep the per-row C kernel (CPU float32, bit-equal to the learner) or SDPA."""

    def takes(self, context_len: int) -> bool:
        return context_len >= self.min_context

    def attend(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        table: torch.Tensor,
        offset: int,
        start: int,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        if self.block_tokens == 0:
            return full_attention(q, key_cache, value_cache, table, offset, start, window, scale)
        return blockwise_attention(
            q, key_cache, value_cache, table, offset, start, window, scale, self.block_tokens
        )


def _first_visible(position: int, window: int | None) -> int:
    """The first position a query at `position` sees (transformers' window: i - window + 1 .. i)."""
    return 0 if window is None else max(0, position - window + 1)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[Q, heads, d] as [kv_heads, group, Q, d]: query head h = kv_head * group + g, as the cache's GQA."""
    tokens, heads, dim = q.shape
    return q.view(tokens, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3)


def _ungrouped(attended: torch.Tensor, kv_heads: int, group: int) -> torch.Tensor:
    """[kv_heads, group * Q, d] back as [Q, heads, d] (`_grouped`'s inverse)."""
    dim = attended.shape[-1]
    rows = attended.shape[1] // group
    return attended.view(kv_heads, group, rows, dim).permute(2, 0, 1, 3).reshape(rows, kv_heads * group, dim)


def _gather(
    cache: torch.Tensor, table: torch.Tensor, offset: int, first: int, end: int, dtype: torch.dtype
) -> torch.Tensor:
    """The cache rows of positions first .. end - 1 ([end - first, kv_heads, d] in `dtype`), `first` a
    multiple of the block size, from the blocks `table` names (its first row is position `offset`)."""
    block_size = cache.shape[1]
    blocks = table[(first - offset) // block_size : (end - offset - 1) // block_size + 1]
    return cache[blocks].flatten(0, 1)[: end - first].to(dtype)


def _mask(scores: torch.Tensor, first_query: int, first_key: int, window: int | None) -> torch.Tensor:
    """Scores [kv_heads, group, Qt, Kt] with the keys a query must not see set to -inf, in place, where
    some are: later keys (causal) and keys before the query's window."""
    queries, keys = scores.shape[2], scores.shape[3]
    last_query, last_key = first_query + queries - 1, first_key + keys - 1
    causal = last_key > first_query
    windowed = window is not None and first_key < last_query - window + 1
    if not (causal or windowed):
        return scores
    query_pos = torch.arange(first_query, last_query + 1, device=scores.device)[:, None]
    key_pos = torch.arange(first_key, last_key + 1, device=scores.device)[None, :]
    hidden = key_pos > query_pos
    if window is not None:
        hidden |= key_pos <= query_pos - window
    return scores.masked_fill_(hidden, float("-inf"))


def blockwise_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    offset: int,
    start: int,
    window: int | None,
    scale: float,
    block_tokens: int,
) -> torch.Tensor:
    """Attention of q ([Q, heads, head_dim], the tokens at positions start .. start + Q - 1) over the cache
    rows `table` names (LongTensor of block ids; its first row is position `offset`, a multiple of the
    block size), causal and within `window`, in tiles of `block_tokens` queries by `block_tokens` keys.
    Returns [Q, heads, head_dim] in q's dtype."""
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if block_tokens < 1 or block_tokens % block_size:
        raise ValueError(f"block_tokens = {block_tokens}: expected a positive multiple of the block size")
    assert offset % block_size == 0 and offset <= _first_visible(start, window), "table starts too late"
    tokens, heads, dim = q.shape
    group = heads // kv_heads
    grouped = _grouped(q * scale, kv_heads)  # scaled once here rather than every score tile
    out = torch.empty_like(q)
    for a in range(0, tokens, block_tokens):
        first_query = start + a
        queries = grouped[:, :, a : a + block_tokens]
        rows = queries.shape[2]
        last_query = first_query + rows - 1
        flat = queries.reshape(kv_heads, group * rows, dim)
        top = torch.full((kv_heads, group * rows, 1), float("-inf"), device=q.device)
        total = torch.zeros((kv_heads, group * rows, 1), device=q.device)
        acc = torch.zeros((kv_heads, group * rows, dim), device=q.device)
        # KV tiles from the block holding the tile's first visible key to its last query's position.
        first_key = _first_visible(first_query, window) // block_size * block_size
        for key_start in range(first_key, last_query + 1, block_tokens):
            key_end = min(key_start + block_tokens, last_query + 1)
            keys = _gather(key_cache, table, offset, key_start, key_end, q.dtype)  # [Kt, kv_heads, d]
            values = _gather(value_cache, table, offset, key_start, key_end, q.dtype)
            scores = torch.bmm(flat, keys.permute(1, 2, 0)).float()  # [kv_heads, g * Qt, Kt]
            scores = _mask(scores.view(kv_heads, group, rows, -1), first_query, key_start, window)
            scores = scores.view(kv_heads, group * rows, -1)
            new_top = torch.maximum(top, scores.amax(dim=-1, keepdim=True))
            # A row that has seen no key yet keeps -inf; shift it by 0 so exp gives 0, not NaN.
            shift = new_top.masked_fill(torch.isinf(new_top), 0.0)
            weights = scores.sub_(shift).exp_()  # in place: the score tile is the largest intermediate
            decay = (top - shift).exp_()
            total.mul_(decay).add_(weights.sum(dim=-1, keepdim=True))
            acc.mul_(decay)
            if weights.dtype == values.dtype:
                acc.baddbmm_(weights, values.transpose(0, 1))
            else:
                acc.add_(torch.bmm(weights.to(values.dtype), values.transpose(0, 1)))
            top = new_top
        out[a : a + rows] = _ungrouped(acc.div_(total), kv_heads, group).to(q.dtype)
    return out


def full_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    offset: int,
    start: int,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """`blockwise_attention`'s result from the chunk's whole [kv_heads, group * Q, K] score matrix at once,
    over one gathered copy of the context it sees: the baseline the block-wise path is measured against."""
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    tokens, heads, dim = q.shape
    group = heads // kv_heads
    first_key = _first_visible(start, window) // block_size * block_size
    end = start + tokens
    keys = _gather(key_cache, table, offset, first_key, end, q.dtype)
    values = _gather(value_cache, table, offset, first_key, end, q.dtype)
    flat = _grouped(q, kv_heads).reshape(kv_heads, group * tokens, dim)
    scores = torch.bmm(flat, keys.permute(1, 2, 0)).float() * scale
    scores = _mask(scores.view(kv_heads, group, tokens, -1), start, first_key, window)
    weights = torch.softmax(scores.view(kv_heads, group * tokens, -1), dim=-1)
    attended = torch.bmm(weights.to(values.dtype), values.transpose(0, 1)).float()
    return _ungrouped(attended, kv_heads, group).to(q.dtype)
