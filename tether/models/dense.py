"""A training forward over our `CausalLM`: whole sequences at once, no KV cache, autograd-capable.

It runs the model's own modules (embedding, norms, projections, rotary, MLP, head) in the same order and
precision as the paged forward the engine uses, so a learner recomputes exactly the logprobs the engine
recorded for the same weights. Only attention differs in layout: a [rows, tokens] batch with a causal mask
restricted to each sequence's own tokens, so sequences may be padded one per row or packed several per
row. On CPU in float32 its values come from the engine's attention kernel, every token over its own keys
in order, and the final normalisation is the sampler's, so the logprobs equal the engine's bit for bit
(with batch-invariant projections: see `layers.Linear`). It does not sample, cache or schedule anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tether.engine.attention import AttentionKernel, kernel_for, native_attention
from tether.models.layers import RotaryEmbedding
from tether.models.transformer import Attention, CausalLM, DecoderLayer


@dataclass(frozen=True, slots=True)
class DenseBatch:
    """Token rows; `segments` numbers the pieces of a row from 1 (0 is padding). A token sees the earlier
    tokens of its own segment, and all of its row's `prefix` segment (a prompt shared by its samples)."""

    input_ids: torch.Tensor  # LongTensor[R, T]
    positions: torch.Tensor  # LongTensor[R, T]: position of each token within its own sequence
    segments: torch.Tensor  # LongTensor[R, T]
    prefix: torch.Tensor  # LongTensor[R]: the segment every token of the row may see (0: none)
    # Sequence i is row columns[i][0], tokens at columns columns[i][1] in order.
    columns: tuple[tuple[int, tuple[int, ...]], ...]

    @classmethod
    def padded(cls, sequences: Sequence[Sequence[int]], pad_id: int = 0) -> DenseBatch:
        """One sequence per row, right-padded to the longest."""
        return cls._layout([[i] for i in range(len(sequences))], sequences, pad_id)

    @classmethod
    def packed(cls, sequences: Sequence[Sequence[int]], row_tokens: int, pad_id: int = 0) -> DenseBatch:
        """Sequences packed first-fit into rows of at most `row_tokens` (a longer one gets its own row)."""
        rows: list[list[int]] = []
        used: list[int] = []
        for index, sequence in enumerate(sequences):
            for row, taken in enumerate(used):
                if taken + len(sequence) <= row_tokens:
                    rows[row].append(index)
                    used[row] += len(sequence)
                    break
            else:
                rows.append([index])
                used.append(len(sequence))
        return cls._layout(rows, sequences, pad_id)

    @classmethod
    def _layout(cls, rows: list[list[int]], sequences: Sequence[Sequence[int]], pad_id: int) -> DenseBatch:
        _check([list(s) for s in sequences])
        pieces = [[(list(sequences[i]), 0) for i in row] for row in rows]
        batch = cls._build(pieces, [0] * len(rows), pad_id)
        order = [i for row in rows for i in row]
        columns: list[tuple[int, tuple[int, ...]]] = [(0, ())] * len(sequences)
        for index, located in zip(order, batch.columns, strict=True):
            columns[index] = located
        return cls(batch.input_ids, batch.positions, batch.segments, batch.prefix, tuple(columns))

    @classmethod
    def shared_prefix(
        cls, groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], pad_id: int = 0
    ) -> DenseBatch:
        """One row per (prefix, continuations) group: the prefix once, then each continuation attending
        to it. Sequence order: every prefix + continuation, group by group. The prompt of n samples is
        computed once instead of n times, and its gradient is the sum over the samples, as it should.
        The learner's layout: a 32-sequence SmolLM2 step took 25.9 CPU-s this way against 48.9 padded."""
        if any(not p or not cs or any(not c for c in cs) for p, cs in groups):
            raise ValueError("a shared-prefix group needs a non-empty prefix and non-empty continuations")
        _check([list(p) + list(c) for p, cs in groups for c in cs])
        pieces = [[(list(p), 0)] + [(list(c), len(p)) for c in cs] for p, cs in groups]
        built = cls._build(pieces, [1] * len(groups), pad_id)
        columns: list[tuple[int, tuple[int, ...]]] = []
        for r, (_, continuations) in enumerate(groups):
            located = [c for c in built.columns if c[0] == r]
            prefix_columns = located[0][1]
            columns.extend((r, prefix_columns + cols) for _, cols in located[1 : 1 + len(continuations)])
        return cls(built.input_ids, built.positions, built.segments, built.prefix, tuple(columns))

    @classmethod
    def _build(cls, rows: list[list[tuple[list[int], int]]], prefix: list[int], pad_id: int) -> DenseBatch:
        """Rows of (tokens, first position) pieces, one segment each; `columns` lists the pieces."""
        width = max(sum(len(tokens) for tokens, _ in row) for row in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        segments = torch.zeros((len(rows), width), dtype=torch.long)
        columns: list[tuple[int, tuple[int, ...]]] = []
        for r, row in enumerate(rows):
            column = 0
            for segment, (tokens, first) in enumerate(row, start=1):
                end = column + len(tokens)
                ids[r, column:end] = torch.tensor(tokens, dtype=torch.long)
                positions[r, column:end] = torch.arange(first, first + len(tokens))
                segments[r, column:end] = segment
                columns.append((r, tuple(range(column, end))))
                column = end
        return cls(ids, positions, segments, torch.tensor(prefix, dtype=torch.long), tuple(columns))

    def to(self, device: torch.device | str) -> DenseBatch:
        return DenseBatch(
            self.input_ids.to(device),
            self.positions.to(device),
            self.segments.to(device),
            self.prefix.to(device),
            self.columns,
        )

    def attention_mask(self) -> torch.Tensor:
        """BoolTensor[R, 1, T, T]: causal within each segment, plus the row's prefix segment. Padding
        attends to itself only, so that its (ignored) rows stay finite instead of softmaxing over nothing."""
        width = self.input_ids.shape[1]
        seg = self.segments
        real = seg[:, :, None] > 0
        same = seg[:, :, None] == seg[:, None, :]
        shared = (seg[:, None, :] == self.prefix[:, None, None]) & (self.prefix[:, None, None] > 0)
        causal = torch.ones(width, width, dtype=torch.bool, device=seg.device).tril()
        eye = torch.eye(width, dtype=torch.bool, device=seg.device)
        return ((real & (same | shared) & causal) | eye)[:, None]

    def key_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys of every token, in order, as flat token indices: (LongTensor[R*T, L], lengths
        LongTensor[R*T]). The same keys as `attention_mask`: the row's prefix segment, then its own
        segment up to itself (padding: itself only)."""
        seg, device = self.segments, self.segments.device
        rows, width = seg.shape
        column = torch.arange(width, device=device).expand(rows, width)
        starts = torch.ones_like(seg, dtype=torch.bool)
        starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
        own_start = torch.where(starts, column, 0).cummax(dim=1).values
        in_prefix = (seg == self.prefix[:, None]) & (self.prefix[:, None] > 0)
        prefix_len = in_prefix.sum(dim=1)
        prefix_start = torch.where(in_prefix, column, width).min(dim=1).values.clamp(max=width - 1)
        seen = torch.where(in_prefix | (seg == 0), 0, prefix_len[:, None])  # prefix keys before its own
        lengths = seen + column - own_start + 1
        j = torch.arange(int(lengths.max()), device=device)
        keys = torch.where(
            j < seen[..., None], prefix_start[:, None, None] + j, own_start[..., None] + j - seen[..., None]
        ).clamp(max=width - 1)
        flat = keys + (torch.arange(rows, device=device) * width)[:, None, None]
        return flat.reshape(rows * width, -1).contiguous(), lengths.reshape(-1).contiguous()


def _check(sequences: list[list[int]]) -> None:
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("a dense batch needs at least one sequence, and no empty sequence")


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked attention over [R*T, heads, head_dim] rows of a [R, 1, T, T] mask, torch's kernels."""
    rows, width = mask.shape[0], mask.shape[-1]

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(rows, width, t.shape[1], t.shape[2]).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        heads(q), heads(k), heads(v), attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out.transpose(1, 2).reshape(q.shape)


class _EngineAttention(torch.autograd.Function):
    """Values from the engine's C kernel (so they equal the engine's bit for bit), gradients from torch's
    attention recomputed in backward (the same function up to rounding)."""

    @staticmethod
    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
        kernel: AttentionKernel,
    ) -> torch.Tensor:
        blocks = (k.shape[0], 1, k.shape[1], k.shape[2])  # one token per block: tables name tokens
        return native_attention(
            q, k.contiguous().view(blocks), v.contiguous().view(blocks), tables, lengths, scale, kernel
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        q, k, v, mask, _, _, scale, _ = inputs
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale = scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved_q, saved_k, saved_v, mask = ctx.saved_tensors
        q, k, v = (t.detach().requires_grad_() for t in (saved_q, saved_k, saved_v))
        with torch.enable_grad():
            out = _sdpa(q, k, v, mask, ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        return dq, dk, dv, None, None, None, None, None


def _attention(
    attn: Attention,
    x: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """`Attention.forward`'s computation over [R, T, hidden] with a dense mask instead of the paged cache."""
    rows, width, _ = x.shape
    flat = x.reshape(rows * width, -1)
    q = attn.q_proj(flat).view(rows * width, attn.num_heads, attn.head_dim)
    k = attn.k_proj(flat).view(rows * width, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(flat).view(rows * width, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None and attn.k_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = cos_sin
    q, k = RotaryEmbedding.rotate(q, cos, sin), RotaryEmbedding.rotate(k, cos, sin)
    kernel = kernel_for(q, k, v)
    if tables is not None and kernel is not AttentionKernel.TORCH_SDPA:
        out: torch.Tensor = _EngineAttention.apply(q, k, v, mask, *tables, attn.scale, kernel)  # type: ignore[no-untyped-call]
    else:
        out = _sdpa(q, k, v, mask, attn.scale)
    projected: torch.Tensor = attn.o_proj(out.reshape(rows * width, -1))
    return projected.view(rows, width, -1)


def hidden_states(model: CausalLM, batch: DenseBatch) -> torch.Tensor:
    """Final-norm hidden states [R, T, hidden] of every token of the batch."""
    decoder = model.model
    x = decoder.embed_tokens(batch.input_ids)
    cos_sin = decoder.rotary.cos_sin(batch.positions.reshape(-1))
    mask = batch.attention_mask()
    tables = batch.key_tables() if x.device.type == "cpu" else None
    for layer in decoder.layers:
        assert isinstance(layer, DecoderLayer)
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos_sin, mask, tables)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    out: torch.Tensor = decoder.norm(x)
    return out


def token_logprobs(
    model: CausalLM,
    batch: DenseBatch,
    targets: Sequence[tuple[int, int]],
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """Logprobs of each sequence's own next tokens over a range of its positions.

    `targets[i] = (start, end)`: for sequence i, the logprobs of its tokens start..end-1, each predicted
    from the tokens before it (so start >= 1). The distribution is the temperature-scaled one the engine
    records (temperature 0, greedy, counts as 1). Only the rows needed go through the output head: the
    vocabulary projection is the largest activation of a small model."""
    if len(targets) != len(batch.columns):
        raise ValueError(f"{len(targets)} target ranges for {len(batch.columns)} sequences")
    hidden = hidden_states(model, batch)
    rows: list[int] = []
    columns: list[int] = []
    wanted: list[int] = []
    for (row, located), (start, end) in zip(batch.columns, targets, strict=True):
        if not 1 <= start <= end <= len(located):
            raise ValueError(f"target range ({start}, {end}) outside a sequence of {len(located)} tokens")
        rows.extend([row] * (end - start))
        columns.extend(located[start - 1 : end - 1])
        wanted.extend(located[start:end])
    device = hidden.device
    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    picked = hidden[row_index, torch.tensor(columns, dtype=torch.long, device=device)]
    logits = model.lm_head(picked).float()
    tokens = batch.input_ids[row_index, torch.tensor(wanted, dtype=torch.long, device=device)]
    # The engine's sampler's own normalisation (`tether.engine.sampling`), so the values agree bit for bit.
    if temperature > 0:
        logprobs = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[:, None])[:, 0]
    else:
        logprobs = logits.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    sizes = [end - start for start, end in targets]
    return list(torch.split(logprobs, sizes))
