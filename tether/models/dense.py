"""A training forward over our `CausalLM`: whole sequences at once, no KV cache, autograd-capable.

It runs the model's own modules (embedding, norms, projections, rotary, MLP, head) in the same order and
precision as the paged forward the engine uses, so a learner recomputes exactly the logprobs the engine
recorded for the same weights. Only attention differs in layout: a [rows, tokens] batch with a causal mask
restricted to each sequence's own tokens, so sequences may be padded one per row or packed several per
row. It does not sample, cache or schedule anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
        Measured on CPU (SmolLM2, 8 prompts x 4 samples) it is slower than `padded` (SDPA's masked path on
        longer rows costs more than the prompt tokens saved), so the learner does not use it yet."""
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


def _check(sequences: list[list[int]]) -> None:
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("a dense batch needs at least one sequence, and no empty sequence")


def _attention(
    attn: Attention, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
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

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(rows, width, t.shape[1], attn.head_dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        heads(q),
        heads(k),
        heads(v),
        attn_mask=mask,
        scale=attn.scale,
        enable_gqa=attn.num_kv_heads != attn.num_heads,
    )
    projected: torch.Tensor = attn.o_proj(out.transpose(1, 2).reshape(rows * width, -1))
    return projected.view(rows, width, -1)


def hidden_states(model: CausalLM, batch: DenseBatch) -> torch.Tensor:
    """Final-norm hidden states [R, T, hidden] of every token of the batch."""
    decoder = model.model
    x = decoder.embed_tokens(batch.input_ids)
    cos_sin = decoder.rotary.cos_sin(batch.positions.reshape(-1))
    mask = batch.attention_mask()
    for layer in decoder.layers:
        assert isinstance(layer, DecoderLayer)
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos_sin, mask)
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
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    tokens = batch.input_ids[row_index, torch.tensor(wanted, dtype=torch.long, device=device)]
    logprobs = logits.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    sizes = [end - start for start, end in targets]
    return list(torch.split(logprobs, sizes))
