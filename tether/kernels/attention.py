"""Attention over the paged KV cache: write the new tokens' K/V into their slots, then attend.

Decoding sequences (one new token each) are attended together: their K/V are gathered from their blocks
into one padded batch and masked by length, so a step with many sequences makes one attention call per
layer. What that call needs (padded block tables, lengths, mask) depends only on the step, not the layer,
so `AttentionMetadata.build` prepares it once. A multi-token chunk (a prefill, or a speculative
verification) is handled on its own: causal (SDPA's `is_causal`, no mask) when nothing is cached, else
with a causal mask offset by its cached length. Decode attention never copies K/V per query head: the
query heads of a group are folded into the query axis (a CUDA chunk repeats them, see `chunk_torch`).
On CPU with float32 queries over float32 or float16 caches (a float16 cache is half the bytes decode
attention reads: `LLMEngine.from_pretrained`'s `kv_cache_dtype`), attention runs in a small C kernel
(`_paged.c`) that reads K/V straight from the blocks instead of gathering a padded copy per layer, for
prefill chunks too (one query row at a time, so a token's attention does not depend on its batch): its
AVX2 path where the CPU has AVX2 and FMA (and F16C for a float16 cache), its portable path elsewhere
(`attention_kernel`). Otherwise it is plain torch (SDPA, on CPU or
CUDA). A layer with a sliding window (`ModelConfig.layer_windows`) has its own view of the step's metadata:
its tables start at the first block its window reaches, so blocks before it are never read (the engine
frees them once no layer needs them). A chunk whose context reaches `LongChunkAttention.min_context` runs
block-wise instead (`tether.kernels.blockwise`): bounded memory at any context, not bit-equal to the C
kernel.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F

from tether.kernels import (
    _paged,  # after torch: its OpenMP runtime is then the one the kernel links to
    cpu,
)
from tether.kernels.blockwise import LongChunkAttention
from tether.kernels.cpu import CpuFeature


class AttentionKernel(Enum):
    C_AVX2 = "C kernel, AVX2"
    C_PORTABLE = "C kernel, portable"
    TORCH_SDPA = "torch SDPA"


def attention_kernel(
    features: frozenset[CpuFeature], dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype | None = None
) -> AttentionKernel:
    """The kernel CPU attention of `dtype` queries over caches of `cache_dtype` (default: `dtype`) takes on
    a machine with `features`: the C kernel for float32 queries over a float32 or float16 cache, on its
    AVX2 path where the CPU has AVX2 and FMA (and F16C, for float16) and head_dim is a multiple of 8."""
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    if dtype != torch.float32 or cache_dtype not in (torch.float32, torch.float16):
        return AttentionKernel.TORCH_SDPA
    half_ready = cache_dtype == torch.float32 or CpuFeature.F16C in features
    if CpuFeature.AVX2_FMA in features and half_ready and head_dim % 8 == 0:
        return AttentionKernel.C_AVX2
    return AttentionKernel.C_PORTABLE


def kernel_for(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> AttentionKernel:
    """The kernel attention of `q` over these caches takes on this machine: `attention_kernel` on CPU when
    the two caches share a dtype and are in their allocated layout, else torch SDPA."""
    if not (
        q.device.type == "cpu"
        and key_cache.dtype == value_cache.dtype
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
    ):
        return AttentionKernel.TORCH_SDPA
    return attention_kernel(cpu.detected(), q.dtype, q.shape[-1], key_cache.dtype)


@dataclass(frozen=True, slots=True)
class SequenceSpan:
    """One sequence's share of a flat batch."""

    query_start: int  # index of its first new token in the flat batch
    query_len: int  # new tokens this step
    start: int  # position of the first new token == tokens already in the cache
    block_table: Sequence[int]  # block ids, covering at least context_len tokens

    @property
    def context_len(self) -> int:
        return self.start + self.query_len


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Every single-token span of a step, padded to the longest context once for all layers of a window.

    Each row's table starts at the first block its window reaches (all of it without a window): the
    positions before are never read, and their blocks may have been freed."""

    rows: torch.Tensor  # LongTensor[B]: each sequence's token in the flat batch
    first_row: int | None  # rows as the range first_row .. first_row + B - 1 when they are one, else None
    tables: torch.Tensor  # LongTensor[B, W]: block tables from the window's first block, padded with 0
    lengths: torch.Tensor  # LongTensor[B]: rows of each table up to and including the new token
    starts: torch.Tensor  # LongTensor[B]: first row of each table the new token sees (0 without window)
    mask: torch.Tensor  # BoolTensor[B, 1, 1, L]: which of the L gathered rows each token sees
    longest: int  # L, the most rows of any table


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """A multi-token span with its block table and mask on the device, for one window."""

    span: SequenceSpan
    table: torch.Tensor
    """LongTensor of the blocks from the first one the chunk's window reaches to its context's end."""
    offset: int
    """Position of the table's first row (0 without a window)."""
    mask: torch.Tensor | None
    """BoolTensor[query_len, context_len - offset], the causal (and window) mask over the table's rows;
    None when nothing is cached and no window cuts in, where SDPA's own `is_causal` is that mask and
    leaves CUDA its flash/memory-efficient kernels (an explicit dense mask rules flash out); None too for a
    chunk that takes the long-chunk path (`AttentionMetadata.long_chunks`), which masks tile by tile."""
    window: int | None


@dataclass(frozen=True, slots=True)
class WindowView:
    """What the layers of one sliding window (None: full causal attention) attend with this step."""

    decode: DecodeGroup | None
    chunks: tuple[ChunkSpan, ...]


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # LongTensor[T]: flat cache slot of each new token
    views: dict[int | None, WindowView]
    """One view per distinct layer window, built once per step for all of its layers."""
    long_chunks: LongChunkAttention
    """How a chunk with a long context attends (`tether.kernels.blockwise`)."""

    @classmethod
    def build(
        cls,
        spans: Sequence[SequenceSpan],
        slot_mapping: torch.Tensor,
        block_size: int,
        windows: Iterable[int | None] = (None,),
        long_chunks: LongChunkAttention | None = None,
    ) -> AttentionMetadata:
        device = slot_mapping.device
        decoding = [span for span in spans if span.query_len == 1]
        long_chunks = long_chunks or LongChunkAttention()
        views = {}
        for window in dict.fromkeys(windows):
            decode = _decode_group(decoding, block_size, window, device) if decoding else None
            chunks = tuple(
                _chunk_span(span, block_size, window, device, masked=not long_chunks.takes(span.context_len))
                for span in spans
                if span.query_len > 1
            )
            views[window] = WindowView(decode, chunks)
        return cls(slot_mapping, views, long_chunks)

    def view(self, window: int | None) -> WindowView:
        assert window in self.views, f"no view for window {window}: build with the model's layer_windows"
        return self.views[window]


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def window_start(position: int, window: int | None) -> int:
    """The first position a query at `position` sees: i - window + 1 (transformers' sliding window)."""
    return 0 if window is None else max(0, position - window + 1)


def _decode_group(
    spans: list[SequenceSpan], block_size: int, window: int | None, device: torch.device
) -> DecodeGroup:
    firsts = [window_start(span.start, window) // block_size for span in spans]
    lengths = [span.context_len - first * block_size for span, first in zip(spans, firsts, strict=True)]
    starts = [
        window_start(span.start, window) - first * block_size
        for span, first in zip(spans, firsts, strict=True)
    ]
    longest = max(lengths)
    width = _blocks_for(longest, block_size)
    padded = [
        list(span.block_table[first : _blocks_for(span.context_len, block_size)])
        for span, first in zip(spans, firsts, strict=True)
    ]
    tables = torch.tensor([row + [0] * (width - len(row)) for row in padded], dtype=torch.long)
    context, first_row = torch.tensor(lengths, dtype=torch.long), torch.tensor(starts, dtype=torch.long)
    gathered = torch.arange(longest)[None, :]
    mask = (gathered < context[:, None]) & (gathered >= first_row[:, None])
    rows = [span.query_start for span in spans]
    return DecodeGroup(
        rows=torch.tensor(rows, dtype=torch.long).to(device),
        first_row=rows[0] if rows == list(range(rows[0], rows[0] + len(rows))) else None,
        tables=tables.to(device),
        lengths=context.to(device),
        starts=first_row.to(device),
        mask=mask[:, None, None, :].to(device),
        longest=longest,
    )


def _chunk_span(
    span: SequenceSpan, block_size: int, window: int | None, device: torch.device, masked: bool
) -> ChunkSpan:
    """`masked` False: a long chunk, whose block-wise attention builds masks per tile (a dense one would
    grow with the context)."""
    first = window_start(span.start, window) // block_size
    offset = first * block_size
    table = torch.tensor(
        span.block_table[first : _blocks_for(span.context_len, block_size)], dtype=torch.long
    )
    if not masked or (span.start == 0 and (window is None or window >= span.context_len)):
        return ChunkSpan(span=span, table=table.to(device), offset=offset, mask=None, window=window)
    query_pos = torch.arange(span.start, span.context_len)[:, None]
    key_pos = torch.arange(offset, span.context_len)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return ChunkSpan(span=span, table=table.to(device), offset=offset, mask=mask.to(device), window=window)


def write_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store k, v ([T, kv_heads, head_dim]) at their flat slots of a [blocks, block_size, ...] cache."""
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, k.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, v.to(value_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]. Returns [T, heads, head_dim]. `window`:
    the layer's sliding window (None: full causal attention), one of the metadata's views."""
    write_kv(key_cache, value_cache, k, v, metadata.slot_mapping)
    out = torch.empty_like(q)
    kv_heads = k.shape[1]
    kernel = kernel_for(q, key_cache, value_cache)
    native = kernel is not AttentionKernel.TORCH_SDPA
    view = metadata.view(window)
    if view.decode is not None:
        if native:
            decode_native(q, key_cache, value_cache, view.decode, kv_heads, scale, out, kernel)
        else:
            decode_torch(q, key_cache, value_cache, view.decode, kv_heads, scale, out)
    for chunk in view.chunks:
        span = chunk.span
        end = span.query_start + span.query_len
        queries = q[span.query_start : end]
        if metadata.long_chunks.takes(span.context_len):
            out[span.query_start : end] = metadata.long_chunks.attend(
                queries, key_cache, value_cache, chunk.table, chunk.offset, span.start, window, scale
            )
        elif native:
            # Every query row of the chunk through the decode kernel, over its own causal prefix: a token's
            # attention is then computed the same way at prefill, at decode and in the learner's dense
            # forward (`tether.models.dense`), so their logprobs agree bit for bit (issue 9).
            positions = torch.arange(span.start, span.context_len, device=q.device)
            first = positions * 0 if window is None else (positions - window + 1).clamp(min=0)
            out[span.query_start : end] = native_attention(
                queries,
                key_cache,
                value_cache,
                chunk.table[None, :].expand(span.query_len, -1).contiguous(),
                positions + 1 - chunk.offset,
                scale,
                kernel,
                starts=first - chunk.offset,
            )
        else:
            out[span.query_start : end] = chunk_torch(queries, key_cache, value_cache, chunk, scale)
    return out


def chunk_torch(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, chunk: ChunkSpan, scale: float
) -> torch.Tensor:
    """Attention of a multi-token chunk's queries ([Q, heads, head_dim]) over its cached context, through
    SDPA as [1, heads, Q, head_dim]: the 4-d layout CUDA's flash and memory-efficient kernels take."""
    rows = chunk.span.context_len - chunk.offset
    keys = key_cache[chunk.table].flatten(0, 1)[:rows].to(q.dtype)
    values = value_cache[chunk.table].flatten(0, 1)[:rows].to(q.dtype)
    groups = q.shape[1] // keys.shape[1]
    if q.device.type != "cpu" and groups > 1:
        # CUDA's memory-efficient kernel (float32's, and half types' where flash declines a shape) takes
        # no grouped K/V: `enable_gqa` works with flash and math only. One chunk's K/V repeated per query
        # head costs far less than the math kernel's [heads, Q, K] scores.
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    attended = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, heads, Q, head_dim]
        keys.transpose(0, 1)[None],  # [1, kv_heads (or heads), K, head_dim]
        values.transpose(0, 1)[None],
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        scale=scale,
        enable_gqa=keys.shape[1] != q.shape[1],
    )
    return attended[0].transpose(0, 1)


def decode_torch(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: DecodeGroup,
    kv_heads: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """One attention call for every sequence that decodes a single token this step.

    The query heads sharing a KV head become that head's query rows ([B, kv_heads, groups, head_dim]),
    which is exact grouped-query attention without repeating K/V."""
    batch, heads, head_dim = len(group.rows), q.shape[1], q.shape[2]
    keys = key_cache[group.tables].flatten(1, 2)[:, : group.longest].to(q.dtype)  # [B, L, kv_heads, d]
    values = value_cache[group.tables].flatten(1, 2)[:, : group.longest].to(q.dtype)
    queries = q[group.rows].view(batch, kv_heads, heads // kv_heads, head_dim)
    attended = F.scaled_dot_product_attention(
        queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=group.mask, scale=scale
    )
    out[group.rows] = attended.reshape(batch, heads, head_dim)


def decode_native(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: DecodeGroup,
    kv_heads: int,
    scale: float,
    out: torch.Tensor,
    kernel: AttentionKernel,
) -> None:
    """`decode_torch` computed by the C kernel on `kernel`'s path, reading K/V in place (`kernel_for`).
    Decode rows that are one range of the batch (a step of decodes only, or decodes before the prefills)
    are read from q and written to `out` in place, without a gather and a scatter per layer."""
    first = group.first_row
    in_place = first is not None and q.is_contiguous() and out.is_contiguous()
    if in_place:
        assert first is not None
        queries, attended = q[first : first + len(group.rows)], out[first : first + len(group.rows)]
    else:
        queries = q[group.rows].contiguous()
        attended = torch.empty_like(queries)
    _paged.decode_attention(
        queries.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        group.tables.data_ptr(),
        group.lengths.data_ptr(),
        group.starts.data_ptr(),
        attended.data_ptr(),
        len(group.rows),
        q.shape[1],
        kv_heads,
        q.shape[2],
        key_cache.shape[1],
        group.tables.shape[1],
        key_cache.shape[0],
        group.longest,
        scale,
        torch.get_num_threads(),
        _vector(kernel),
        key_cache.dtype == torch.float16,
    )
    if not in_place:
        out[group.rows] = attended


def native_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    kernel: AttentionKernel,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The C kernel on `kernel`'s path over any rows: query row i ([N, heads, head_dim]) attends, in order,
    to the cached rows starts[i] .. lengths[i] - 1 (starts: 0 when None) its block table tables[i] names.
    float32 queries on the CPU, over a float32 or float16 cache (`kernel_for`)."""
    queries = q.contiguous()
    attended = torch.empty_like(queries)
    first = torch.zeros_like(lengths) if starts is None else starts.to(torch.long).contiguous()
    _paged.decode_attention(
        queries.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        tables.data_ptr(),
        lengths.data_ptr(),
        first.data_ptr(),
        attended.data_ptr(),
        queries.shape[0],
        queries.shape[1],
        key_cache.shape[2],
        queries.shape[2],
        key_cache.shape[1],
        tables.shape[1],
        key_cache.shape[0],
        int(lengths.max()),
        scale,
        torch.get_num_threads(),
        _vector(kernel),
        key_cache.dtype == torch.float16,
    )
    return attended


def _vector(kernel: AttentionKernel) -> bool:
    """The C kernel's `vector` argument for one of its paths."""
    assert kernel is not AttentionKernel.TORCH_SDPA, "attention torch SDPA serves reached the C kernel"
    return kernel is AttentionKernel.C_AVX2
