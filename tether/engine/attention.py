"""Attention over the paged KV cache: write the new tokens' K/V into their slots, then attend.

Decoding sequences (one new token each) are attended together: their K/V are gathered from their blocks
into one padded batch and masked by length, so a step with many sequences makes one attention call.
A prefill chunk is handled on its own, with a causal mask offset by its cached length. Plain torch on
CPU or CUDA; a fused paged kernel can replace `paged_attention` later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class SequenceSpan:
    """One sequence's share of a flat batch."""

    query_start: int  # index of its first new token in the flat batch
    query_len: int  # new tokens this step
    start: int  # position of the first new token == tokens already in the cache
    block_table: torch.Tensor  # LongTensor of block ids, on the cache's device

    @property
    def context_len(self) -> int:
        return self.start + self.query_len


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    spans: tuple[SequenceSpan, ...]
    slot_mapping: torch.Tensor  # LongTensor[T]: flat cache slot of each new token


def write_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store k, v ([T, kv_heads, head_dim]) at their flat slots of a [blocks, block_size, ...] cache."""
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, k.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, v.to(value_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of a sequence, as [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    blocks = -(-length // block_size)
    return cache[block_table[:blocks]].flatten(0, 1)[:length]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]. Returns [T, heads, head_dim]."""
    write_kv(key_cache, value_cache, k, v, metadata.slot_mapping)
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    decoding = [span for span in metadata.spans if span.query_len == 1]
    if len(decoding) > 1:
        _decode_together(q, key_cache, value_cache, decoding, groups, scale, out)
    else:
        decoding = []
    for span in metadata.spans:
        if decoding and span.query_len == 1:
            continue
        end = span.query_start + span.query_len
        keys = _expand(gather_kv(key_cache, span.block_table, span.context_len).to(q.dtype), groups, 1)
        values = _expand(gather_kv(value_cache, span.block_table, span.context_len).to(q.dtype), groups, 1)
        mask = None
        if span.query_len > 1:
            query_pos = torch.arange(span.start, span.context_len, device=q.device)
            key_pos = torch.arange(span.context_len, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]
        attended = F.scaled_dot_product_attention(
            q[span.query_start : end].transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
        )
        out[span.query_start : end] = attended.transpose(0, 1)
    return out


def _expand(kv: torch.Tensor, groups: int, head_dim: int) -> torch.Tensor:
    """Repeat each KV head for its query group (grouped-query attention)."""
    return kv.repeat_interleave(groups, dim=head_dim) if groups > 1 else kv


def _decode_together(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    spans: list[SequenceSpan],
    groups: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """One attention call for every sequence that decodes a single token this step."""
    block_size = key_cache.shape[1]
    lengths = torch.tensor([span.context_len for span in spans], device=q.device)
    longest = int(lengths.max())
    width = -(-longest // block_size)
    tables = torch.zeros((len(spans), width), dtype=torch.long, device=q.device)
    for row, span in enumerate(spans):
        used = span.block_table[: -(-span.context_len // block_size)]
        tables[row, : used.numel()] = used
    keys = _expand(key_cache[tables].flatten(1, 2)[:, :longest].to(q.dtype), groups, 2)
    values = _expand(value_cache[tables].flatten(1, 2)[:, :longest].to(q.dtype), groups, 2)
    mask = torch.arange(longest, device=q.device)[None, :] < lengths[:, None]
    rows = torch.tensor([span.query_start for span in spans], device=q.device)
    attended = F.scaled_dot_product_attention(
        q[rows][:, :, None],  # [B, heads, 1, head_dim]
        keys.transpose(1, 2),  # [B, heads, L, head_dim]
        values.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
    )
    out[rows] = attended[:, :, 0]
