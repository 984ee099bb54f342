"""A training forward over our `CausalLM`: whole sequences at once, no KV cache, autograd-capable.

It runs the model's own modules (embedding, norms, projections, rotary, MLP, head) in the same order and
precision as the paged forward the engine uses, so a learner recomputes exactly the logprobs the engine
recorded for the same weights. Only attention differs in layout: a [rows, tokens] batch cut into documents
(sequences padded one per row, or packed several per row; a shared prompt is a document its samples also
see), each attending causally to its own tokens and its context, in two SDPA calls a layer (documents
without a context, then those with one): memory grows with the documents' own sizes, not a row's length
squared, and there is no dense row mask. A layer with a sliding window sees only the last `window` keys of
each token; documents longer than the window are then cut into window-sized query tiles
(`attention_blocks(window)`), so memory grows with tokens x window.
On CPU in float32 the forward values come from the engine's attention kernel, every token over its own
keys in order, and the final normalisation is the sampler's, so the logprobs equal the engine's bit for
bit (with batch-invariant projections: see `layers.Linear`). It does not sample, cache or schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from tether.kernels.attention import AttentionKernel, kernel_for, native_attention
from tether.models.config import ModelConfig, UnsupportedModelError
from tether.models.layers import RotaryEmbedding
from tether.models.transformer import Attention, CausalLM, DecoderLayer, DecoderModel

# An attention over flat tokens the forward can be given instead of its own (e.g. a ring over the ranks
# that hold the other tokens, `tether.rl.context_parallel`): (q [N, heads, head_dim], k and v
# [N, kv_heads, head_dim], scale) -> [N, heads, head_dim].
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


class Decoder(Protocol):
    """What `hidden_states` reads of a model: its config and decoder stack (`CausalLM`, and the sequence
    classifier of `classifier.py`, which has a score head instead of the vocabulary)."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def model(self) -> DecoderModel: ...


@dataclass(frozen=True, slots=True)
class Document:
    """One sequence piece of a row: tokens `start`..`start + length - 1`, each seeing the earlier ones
    and, first, the whole `context` span of the same row (a prompt shared by its samples; length 0: none)."""

    row: int
    start: int
    length: int
    context_start: int = 0
    context_length: int = 0


@dataclass(frozen=True, slots=True)
class AttentionBlock:
    """Documents computed in one attention call: queries [B, Lq] and keys [B, Lk] as flat token indices,
    `mask` [B, 1, Lq, Lk] (None: plain causal, every document of the same length and no context), `slots`
    the flat indices into B x Lq of the real tokens (padding slots attend to their first key, then are
    dropped; index tensors rather than a boolean mask, so that a meta-device forward can select them)."""

    queries: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor | None
    slots: torch.Tensor

    @property
    def score_elements(self) -> int:
        """Attention scores per head this block computes (B x Lq x Lk)."""
        return self.queries.numel() * self.keys.shape[1]


@dataclass(frozen=True, slots=True)
class DenseBatch:
    """Token rows cut into `documents`; `segments` numbers them within a row from 1 (0 is padding). A
    token sees the earlier tokens of its own document and all of its document's context."""

    input_ids: torch.Tensor  # LongTensor[R, T]
    positions: torch.Tensor  # LongTensor[R, T]: position of each token within its own sequence
    segments: torch.Tensor  # LongTensor[R, T]
    documents: tuple[Document, ...]
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
        pieces = [[_Piece(list(sequences[i]), 0, None) for i in row] for row in rows]
        batch = cls._build(pieces, pad_id)
        order = [i for row in rows for i in row]
        columns: list[tuple[int, tuple[int, ...]]] = [(0, ())] * len(sequences)
        for index, located in zip(order, batch.columns, strict=True):
            columns[index] = located
        return cls(batch.input_ids, batch.positions, batch.segments, batch.documents, tuple(columns))

    @classmethod
    def shared_prefix(
        cls, groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], pad_id: int = 0
    ) -> DenseBatch:
        """Every (prefix, continuations) group packed into one row: each prefix once, then its
        continuations attending to it. Sequence order: every prefix + continuation, group by group. The
        prompt of n samples is computed once instead of n times, and its gradient is the sum over the
        samples, as it should. The learner's layout: a 32-sequence SmolLM2 step took 25.9 CPU-s this way
        against 48.9 padded; attention costs each document's own keys, not the row's squared length."""
        if any(not p or not cs or any(not c for c in cs) for p, cs in groups):
            raise ValueError("a shared-prefix group needs a non-empty prefix and non-empty continuations")
        _check([list(p) + list(c) for p, cs in groups for c in cs])
        row: list[_Piece] = []
        for prefix, continuations in groups:
            context = len(row)
            row.append(_Piece(list(prefix), 0, None))
            row.extend(_Piece(list(c), len(prefix), context) for c in continuations)
        built = cls._build([row], pad_id)
        columns: list[tuple[int, tuple[int, ...]]] = []
        for piece, (r, cols) in zip(row, built.columns, strict=True):
            if piece.context is not None:
                columns.append((r, built.columns[piece.context][1] + cols))
        return cls(built.input_ids, built.positions, built.segments, built.documents, tuple(columns))

    @classmethod
    def _build(cls, rows: list[list[_Piece]], pad_id: int) -> DenseBatch:
        """Rows of pieces, one segment and one document each; `columns` lists the pieces in order."""
        width = max(sum(len(piece.tokens) for piece in row) for row in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        segments = torch.zeros((len(rows), width), dtype=torch.long)
        columns: list[tuple[int, tuple[int, ...]]] = []
        documents: list[Document] = []
        for r, row in enumerate(rows):
            column = 0
            starts: list[int] = []
            for segment, piece in enumerate(row, start=1):
                end = column + len(piece.tokens)
                ids[r, column:end] = torch.tensor(piece.tokens, dtype=torch.long)
                positions[r, column:end] = torch.arange(piece.first, piece.first + len(piece.tokens))
                segments[r, column:end] = segment
                columns.append((r, tuple(range(column, end))))
                context_start = context_length = 0
                if piece.context is not None:
                    context_start, context_length = starts[piece.context], len(row[piece.context].tokens)
                documents.append(Document(r, column, len(piece.tokens), context_start, context_length))
                starts.append(column)
                column = end
        return cls(ids, positions, segments, tuple(documents), tuple(columns))

    def to(self, device: torch.device | str) -> DenseBatch:
        return DenseBatch(
            self.input_ids.to(device),
            self.positions.to(device),
            self.segments.to(device),
            self.documents,
            self.columns,
        )

    def attention_blocks(self, window: int | None = None) -> tuple[AttentionBlock, ...]:
        """The documents in at most two attention calls: those without a context (prompts, unshared
        sequences), then those with one (a prompt's samples, over its keys and their own). Each call is
        padded only to its own longest document, so attention holds about the sum over documents of
        queries x keys, where one mask over a row held the row's length squared.

        With a sliding `window` shorter than a document and its context, the documents are cut instead
        into tiles of `window` queries, each over the at most 2 * window - 1 keys its queries see: memory
        grows with the tokens times the window, never with a document's length squared."""
        width, device = self.input_ids.shape[1], self.input_ids.device
        if window is not None and window < max(d.context_length + d.length for d in self.documents):
            return (_windowed_block(self.documents, width, window, device),)
        plain = [d for d in self.documents if not d.context_length]
        shared = [d for d in self.documents if d.context_length]
        return tuple(_block(group, width, device) for group in (plain, shared) if group)

    def key_tables(self, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys of every token, in order, as flat token indices: (LongTensor[R*T, L], lengths
        LongTensor[R*T]): its document's context, then its own document up to itself (padding: itself);
        with a sliding `window`, only the last `window` of those (L is then at most the window)."""
        rows, width = self.input_ids.shape
        lengths = torch.ones(rows * width, dtype=torch.long)
        longest = max(d.context_length + d.length for d in self.documents)
        span = longest if window is None else min(longest, window)
        keys = torch.arange(rows * width, dtype=torch.long)[:, None].repeat(1, span)
        for d in self.documents:
            base = d.row * width
            own = torch.arange(d.length)
            seen = torch.cat((torch.arange(d.context_length) + base + d.context_start, own + base + d.start))
            position = d.context_length + own  # of each own token in the sequence: seen[position] is itself
            first = torch.zeros_like(position) if window is None else (position - window + 1).clamp(min=0)
            index = first[:, None] + torch.arange(span)[None, :]
            visible = index <= position[:, None]
            tokens = base + d.start + own
            picked = seen[index.clamp(max=len(seen) - 1)]
            keys[tokens] = torch.where(visible, picked, tokens[:, None])
            lengths[tokens] = position - first + 1
        device = self.input_ids.device
        return keys.to(device), lengths.to(device)


@dataclass(frozen=True, slots=True)
class _Piece:
    tokens: list[int]
    first: int  # position of its first token
    context: int | None  # index in its row of the piece it also sees


def _block(documents: list[Document], width: int, device: torch.device) -> AttentionBlock:
    """Document b's keys: its context, then its own tokens (padding slots repeat its first token)."""
    lengths = torch.tensor([d.length for d in documents])
    contexts = torch.tensor([d.context_length for d in documents])
    longest = int(lengths.max())
    slot = torch.arange(longest)
    valid = slot[None, :] < lengths[:, None]
    starts = torch.tensor([d.row * width + d.start for d in documents])
    queries = starts[:, None] + torch.where(valid, slot[None, :], 0)
    span = int((contexts + lengths).max())
    j = torch.arange(span)[None, :]
    context_starts = torch.tensor([d.row * width + d.context_start for d in documents])[:, None]
    own = j - contexts[:, None]
    in_own = (own >= 0) & (own < lengths[:, None])
    keys = torch.where(
        j < contexts[:, None], context_starts + j, starts[:, None] + torch.where(in_own, own, 0)
    )
    mask = None
    if bool(contexts.any()) or not bool(valid.all()):
        i = slot[None, :, None]
        sees = (j[:, None, :] < contexts[:, None, None]) | ((own[:, None, :] >= 0) & (own[:, None, :] <= i))
        mask = torch.where(valid[:, :, None], sees, j[:, None, :] == 0)[:, None].to(device)
    slots = valid.reshape(-1).nonzero()[:, 0]
    return AttentionBlock(queries.to(device), keys.to(device), mask, slots.to(device))


def _windowed_block(
    documents: Sequence[Document], width: int, window: int, device: torch.device
) -> AttentionBlock:
    """Every document cut into tiles of `window` queries; tile b's keys are the context and own tokens
    its queries see (positions first - window + 1 .. last), masked causally and by the window."""
    queries: list[torch.Tensor] = []
    keys: list[torch.Tensor] = []
    query_pos: list[torch.Tensor] = []
    key_pos: list[torch.Tensor] = []
    for d in documents:
        base = d.row * width
        seen = torch.cat(
            (torch.arange(d.context_length) + base + d.context_start, torch.arange(d.length) + base + d.start)
        )
        for first in range(d.context_length, d.context_length + d.length, window):
            last = min(first + window, d.context_length + d.length)  # one past the tile's last query
            lowest = max(0, first - window + 1)
            queries.append(seen[first:last])
            keys.append(seen[lowest:last])
            query_pos.append(torch.arange(first, last))
            key_pos.append(torch.arange(lowest, last))
    longest_q, longest_k = max(len(q) for q in queries), max(len(k) for k in keys)

    q_pos, k_pos = _pad_rows(query_pos, longest_q, -1), _pad_rows(key_pos, longest_k, -1)
    valid = q_pos >= 0
    sees = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])
    sees &= k_pos[:, None, :] > q_pos[:, :, None] - window
    slot = torch.arange(longest_k)
    mask = torch.where(valid[:, :, None], sees, slot[None, None, :] == 0)
    slots = valid.reshape(-1).nonzero()[:, 0]
    return AttentionBlock(
        _pad_rows(queries, longest_q, None).to(device),
        _pad_rows(keys, longest_k, None).to(device),
        mask[:, None].to(device),
        slots.to(device),
    )


def _pad_rows(rows: list[torch.Tensor], size: int, fill: int | None) -> torch.Tensor:
    """1-d rows stacked, right-padded to `size` with `fill` (None: each row's first entry)."""
    return torch.stack(
        [
            torch.cat(
                (r, r[:1].repeat(size - len(r)) if fill is None else r.new_full((size - len(r),), fill))
            )
            for r in rows
        ]
    )


def _check(sequences: list[list[int]]) -> None:
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("a dense batch needs at least one sequence, and no empty sequence")


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: Sequence[AttentionBlock],
    scale: float,
) -> torch.Tensor:
    """Attention of flat [N, heads, head_dim] tokens, one torch SDPA call per block (a causal one where
    the block needs no mask, which lets CUDA pick its flash kernel); padding tokens get zeros."""
    gqa = k.shape[1] != q.shape[1]
    targets, values = [], []
    for block in blocks:
        out = F.scaled_dot_product_attention(
            q[block.queries].transpose(1, 2),
            k[block.keys].transpose(1, 2),
            v[block.keys].transpose(1, 2),
            attn_mask=block.mask,
            is_causal=block.mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        targets.append(block.queries.reshape(-1)[block.slots])
        values.append(out.transpose(1, 2).reshape(-1, *q.shape[1:])[block.slots])
    return q.new_zeros(q.shape).index_copy(0, torch.cat(targets), torch.cat(values))


class _EngineAttention(torch.autograd.Function):
    """Values from the engine's C kernel (so they equal the engine's bit for bit), gradients from torch's
    attention recomputed in backward (the same function up to rounding)."""

    @staticmethod
    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        blocks: tuple[AttentionBlock, ...],
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
        kernel: AttentionKernel,
    ) -> torch.Tensor:
        paged = (k.shape[0], 1, k.shape[1], k.shape[2])  # one token per cache block: tables name tokens
        return native_attention(
            q, k.contiguous().view(paged), v.contiguous().view(paged), tables, lengths, scale, kernel
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        q, k, v, blocks, _, _, scale, _ = inputs
        ctx.save_for_backward(q, k, v)
        ctx.blocks = blocks
        ctx.scale = scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = _sdpa(q, k, v, ctx.blocks, ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        return dq, dk, dv, None, None, None, None, None


def _attention(
    attn: Attention,
    x: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    blocks: tuple[AttentionBlock, ...],
    tables: tuple[torch.Tensor, torch.Tensor] | None,
    attend: Attend | None = None,
) -> torch.Tensor:
    """`Attention.forward`'s computation over [R, T, hidden], each document over its own keys instead
    of the paged cache (or by `attend`, when given)."""
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
    out: torch.Tensor
    if attend is not None:
        out = attend(q, k, v, attn.scale)
    elif tables is not None and kernel is not AttentionKernel.TORCH_SDPA:
        out = _EngineAttention.apply(q, k, v, blocks, *tables, attn.scale, kernel)  # type: ignore[no-untyped-call]
    else:
        out = _sdpa(q, k, v, blocks, attn.scale)
    projected: torch.Tensor = attn.o_proj(out.reshape(rows * width, -1))
    return projected.view(rows, width, -1)


def hidden_states(model: Decoder, batch: DenseBatch, attend: Attend | None = None) -> torch.Tensor:
    """Final-norm hidden states [R, T, hidden] of every token of the batch; with `attend`, every
    layer's attention is that function's (the batch's documents are then not read)."""
    decoder = model.model
    x = decoder.embed_tokens(batch.input_ids)
    cos_sin = decoder.rotary.cos_sin(batch.positions.reshape(-1))
    windows = set(model.config.layer_windows)
    if attend is not None and windows != {None}:
        # The ring's layout (`tether.rl.context_parallel`) sees whole documents, not windows.
        raise UnsupportedModelError("context-parallel attention does not support sliding-window layers")
    blocks = {window: batch.attention_blocks(window) for window in windows} if attend is None else {}
    on_cpu = x.device.type == "cpu" and attend is None
    tables = {window: batch.key_tables(window) for window in windows} if on_cpu else None
    for layer in decoder.layers:
        assert isinstance(layer, DecoderLayer)
        window = layer.self_attn.window
        layer_tables = None if tables is None else tables[window]
        normed = layer.input_layernorm(x)
        x = x + _attention(layer.self_attn, normed, cos_sin, blocks.get(window, ()), layer_tables, attend)
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
    tokens = batch.input_ids[row_index, torch.tensor(wanted, dtype=torch.long, device=device)]
    logprobs = head_logprobs(model, picked, tokens, temperature)
    sizes = [end - start for start, end in targets]
    return list(torch.split(logprobs, sizes))


def head_logprobs(
    model: CausalLM, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Logprob [N] of `tokens` [N] under the output head over final hidden states [N, hidden]."""
    logits = model.lm_head(hidden).float()
    # The engine's sampler's own normalisation (`tether.engine.sampling`), so the values agree bit for bit.
    if temperature > 0:
        # x / 1 is x exactly: at temperature 1 the two passes over [N, vocab] (forward and backward)
        # would change no bit.
        scaled = logits if temperature == 1 else logits / temperature
        logprobs: torch.Tensor = _PickedLogSoftmax.apply(scaled, tokens)  # type: ignore[no-untyped-call]
    else:
        logprobs = logits.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    return logprobs


class _PickedLogSoftmax(torch.autograd.Function):
    """log_softmax(logits)[i, tokens[i]] with the same forward values as torch's, and a backward that
    writes the [N, vocab] gradient in one pass (-softmax * g, plus g at the picked token) instead of
    autograd's three (a zero gradient for the gather, its scatter, then log_softmax's backward)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        log_softmax = torch.log_softmax(logits, dim=-1)
        ctx.save_for_backward(log_softmax, tokens)
        return log_softmax.gather(-1, tokens[:, None])[:, 0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        log_softmax, tokens = ctx.saved_tensors
        grad_logits = log_softmax.exp().mul_(-grad[:, None])
        grad_logits.scatter_add_(-1, tokens[:, None], grad[:, None])
        return grad_logits, None
