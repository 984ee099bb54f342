"""Context parallelism: one packed row of documents split across the ranks of a group, attention by ring.

A `ContextLayout` cuts the flat tokens of a `DenseBatch` (padded to a multiple of 2 x ranks) into 2 x
ranks chunks and gives rank r chunks r and 2 x ranks - 1 - r (zigzag: under a causal mask every rank then
has about the same number of visible query-key pairs). Everything in the model but attention is per
token, so each rank runs the training forward on its own tokens only (`dense.hidden_states` with an
`attend`); `ring_attention` computes each layer's attention by passing K/V blocks around the ring
(`batch_isend_irecv`: gloo on CPU, NCCL on CUDA; the next block's transfer overlaps the current block's
compute), merging the partial results by their log-sum-exp. A block is computed in tiles of at most
`TILE_TOKENS` queries x keys, so the largest temporary is one tile's scores whatever the length. Who
sees whom is the dense forward's rule (a token sees the earlier tokens of its own document and the whole
of its document's context), decided per tile pair from O(T) per-token tables every rank holds; a tile
pair with no visible key is skipped. The backward runs the ring again from the saved q, k, v, output and
log-sum-exp (FlashAttention-2's recomputation): the score tiles are recomputed, dQ stays home and each
block's dK/dV travels with it, arriving home after the last step. No [T, T] tensor exists, in pieces or
whole: what is saved for backward is O(T / ranks) a rank. `token_logprobs` is `dense.token_logprobs`
over the group: each rank scores the tokens whose hidden state it holds and the ranks sum the vectors
(the backward is the identity, since every rank computes the same loss from the summed logprobs).

Why not `torch.distributed.tensor.experimental.context_parallel`: its ring dispatches only CUDA SDPA
kernels (flash, memory-efficient, cuDNN; the CPU flash kernel is not handled), refuses any `attn_mask`
(our packed rows need document and shared-prompt masks) and works on DTensors; its flex-attention path
all-gathers every K/V instead of passing blocks and needs `torch.compile`. Sliding-window layers are not
handled here (they would only narrow the visible-pair rule). Scores are plain matmuls in float32, not a
fused kernel: a CUDA flash kernel that returns the log-sum-exp could replace `_scores` per tile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from tether.errors import ConfigError
from tether.models.dense import DenseBatch, head_logprobs, hidden_states
from tether.models.transformer import CausalLM

# Queries and keys per score tile: [heads, 512, 512] float32 is 1 MiB a head, whatever the length.
TILE_TOKENS = 512


@dataclass(frozen=True, slots=True)
class RingGroup:
    """This process's place in its context-parallel group: `size` consecutive global ranks in a ring."""

    group: dist.ProcessGroup
    rank: int  # within the group
    size: int
    members: tuple[int, ...]  # their global ranks, in ring order

    @classmethod
    def open(cls, size: int, timeout_s: float) -> RingGroup:
        """Split the default process group into groups of `size` consecutive ranks (every rank must call
        this, in the same order as its other group creations); this rank's group."""
        world = dist.get_world_size()
        if size < 1 or world % size:
            raise ConfigError(
                f"learner.context_parallel = {size} does not divide the {world} learner ranks: "
                f"use a divisor of learner.world_size"
            )
        timeout = timedelta(seconds=timeout_s)
        group, _ = dist.new_subgroups(group_size=size, timeout=timeout)  # type: ignore[no-untyped-call]
        assert group is not None
        first = dist.get_rank() // size * size
        return cls(group, dist.get_rank(group), size, tuple(range(first, first + size)))

    def exchange(
        self, tensors: Sequence[torch.Tensor], first_tag: int = 0
    ) -> Callable[[], list[torch.Tensor]]:
        """Send `tensors` to the next rank and receive the previous rank's (same shapes and dtypes),
        tagged from `first_tag` (two exchanges in flight at once need tags of their own); the returned
        function waits for the transfer and gives what arrived."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        following = self.members[(self.rank + 1) % self.size]
        preceding = self.members[(self.rank - 1) % self.size]
        ops = [dist.P2POp(dist.isend, t, following, self.group, first_tag + i) for i, t in enumerate(sent)]
        ops += [
            dist.P2POp(dist.irecv, t, preceding, self.group, first_tag + i) for i, t in enumerate(received)
        ]
        works = dist.batch_isend_irecv(ops)

        def wait() -> list[torch.Tensor]:
            for work in works:
                work.wait()
            sent.clear()  # held until here: a send reads its tensor until it completes
            return received

        return wait


@dataclass(frozen=True, slots=True)
class ContextLayout:
    """The flat tokens of a batch cut into 2 x `ranks` chunks of `chunk` tokens, zigzag over the ranks,
    and who sees whom: token i sees token j <= i if j is of its own document or of its context."""

    ranks: int
    chunk: int
    tokens: int  # real tokens; those from `tokens` to 2 x ranks x chunk are padding
    tile_tokens: int  # queries and keys per score tile: a tile's scores are the largest temporary
    documents: torch.Tensor  # LongTensor[padded]: the document of each token (padding: its own)
    contexts: torch.Tensor  # LongTensor[padded]: the document each token also sees whole (-1: none)

    @classmethod
    def of(cls, batch: DenseBatch, ranks: int, tile_tokens: int = TILE_TOKENS) -> ContextLayout:
        """The layout of `batch`'s rows, one after the other (a row's documents are its own)."""
        rows, width = batch.input_ids.shape
        per_row = int(batch.segments.max()) + 1
        offsets = torch.arange(rows, device=batch.segments.device)[:, None] * per_row
        documents = (batch.segments + offsets).reshape(-1)
        contexts = torch.full((rows * width,), -1, dtype=torch.long, device=documents.device)
        for d in batch.documents:
            if d.context_length:
                first = d.row * width + d.start
                contexts[first : first + d.length] = documents[d.row * width + d.context_start]
        return cls.split(documents, contexts, ranks, tile_tokens)

    @classmethod
    def split(
        cls, documents: torch.Tensor, contexts: torch.Tensor, ranks: int, tile_tokens: int = TILE_TOKENS
    ) -> ContextLayout:
        """Tokens with these documents and contexts (LongTensor[T] each; -1: no context) over `ranks`."""
        tokens = documents.numel()
        if ranks < 1:
            raise ConfigError(f"context_parallel = {ranks}: expected at least 1 rank")
        if tokens < ranks:
            raise ConfigError(
                f"a {tokens}-token forward cannot be split over context_parallel = {ranks} ranks: every "
                f"rank needs at least one token; use fewer ranks or longer micro-batches"
            )
        if tile_tokens < 1:
            raise ValueError(f"tile_tokens = {tile_tokens}: expected at least 1")
        if contexts.shape != documents.shape:
            raise ValueError(f"{contexts.numel()} contexts for {tokens} tokens")
        chunk = -(-tokens // (2 * ranks))
        padding = 2 * ranks * chunk - tokens
        # Each padding token is a document of its own: it sees only itself, and no real token sees it.
        device = documents.device
        base = int(documents.max()) + 1
        documents = torch.cat((documents, base + torch.arange(padding, device=device)))
        contexts = torch.cat(
            (contexts.to(device), torch.full((padding,), -1, dtype=torch.long, device=device))
        )
        return cls(ranks, chunk, tokens, tile_tokens, documents, contexts)

    def order(self, rank: int) -> tuple[int, int]:
        """Which chunks of the sequence `rank` holds: r and 2 x ranks - 1 - r."""
        return rank, 2 * self.ranks - 1 - rank

    def chunks(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat token indices of `rank`'s two chunks (padding ones are >= `tokens`), on the layout's
        device."""
        first, second = self.order(rank)
        device = self.documents.device
        return (
            torch.arange(first * self.chunk, (first + 1) * self.chunk, device=device),
            torch.arange(second * self.chunk, (second + 1) * self.chunk, device=device),
        )

    def indices(self, rank: int) -> torch.Tensor:
        """The flat token indices `rank` holds, in its local order (its two chunks)."""
        return torch.cat(self.chunks(rank))

    def visible(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """BoolTensor[len(queries), len(keys)]: which keys each query token sees."""
        document = self.documents[queries][:, None]
        sees = (self.documents[keys][None, :] == document) | (
            self.documents[keys][None, :] == self.contexts[queries][:, None]
        )
        return sees & (keys[None, :] <= queries[:, None])


def _tiles(layout: ContextLayout, rank: int) -> list[tuple[slice, int]]:
    """`rank`'s local tokens in tiles of at most `layout.tile_tokens`, none across its two chunks: (local
    slice, flat index of its first token)."""
    tiles = []
    for a, chunk in enumerate(layout.order(rank)):
        for offset in range(0, layout.chunk, layout.tile_tokens):
            end = min(offset + layout.tile_tokens, layout.chunk)
            tiles.append(
                (slice(a * layout.chunk + offset, a * layout.chunk + end), chunk * layout.chunk + offset)
            )
    return tiles


def _pairs(
    layout: ContextLayout, rank: int, source: int
) -> Iterator[tuple[slice, slice, torch.Tensor | None]]:
    """The tile pairs of `rank`'s queries and `source`'s keys that see something: (query slice, key
    slice, mask or None where every key is seen), as slices of the two ranks' local tokens. One mask
    at a time: each exists only while its pair is computed."""
    device = layout.documents.device
    for queries, first_query in _tiles(layout, rank):
        last_query = first_query + queries.stop - queries.start - 1
        for keys, first_key in _tiles(layout, source):
            if first_key > last_query:  # every key after every query: causally invisible
                continue
            mask = layout.visible(
                torch.arange(first_query, last_query + 1, device=device),
                torch.arange(first_key, first_key + keys.stop - keys.start, device=device),
            )
            if bool(mask.any()):
                yield queries, keys, None if bool(mask.all()) else mask


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """[kv_heads, group, Lq, Lk] scores of q [kv_heads, group, Lq, D] against k [kv_heads, Lk, D]."""
    scores = (q @ k[:, None].transpose(-1, -2)) * scale
    return scores if mask is None else scores.masked_fill(~mask, -torch.inf)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[N, heads, D] -> float32 [kv_heads, heads // kv_heads, N, D] (query heads sharing a KV head)."""
    tokens, heads, dim = q.shape
    return q.float().view(tokens, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """`x` with -inf (a row that sees nothing yet) as 0, so that differences with it stay finite."""
    return torch.where(torch.isneginf(x), torch.zeros_like(x), x)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: ContextLayout,
        ring: RingGroup,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(q.device.type, enabled=False):
            kv_heads = k.shape[1]
            queries = _grouped(q, kv_heads)
            out = torch.zeros_like(queries)
            lse = torch.full(queries.shape[:-1], -torch.inf, device=q.device)
            block = [k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()]  # [kv_heads, N, D]
            for step in range(ring.size):
                source = (ring.rank - step) % ring.size
                arriving = ring.exchange(block) if step < ring.size - 1 else None
                keys, values = (t.float() for t in block)
                for qs, ks, mask in _pairs(layout, ring.rank, source):
                    scores = _scores(queries[:, :, qs], keys[:, ks], mask, scale)
                    part_lse = torch.logsumexp(scores, dim=-1)
                    part = torch.exp(scores - _finite(part_lse)[..., None]) @ values[:, None, ks]
                    merged = torch.logaddexp(lse[..., qs], part_lse)
                    out[:, :, qs] = (
                        out[:, :, qs] * torch.exp(lse[..., qs] - _finite(merged))[..., None]
                        + part * torch.exp(part_lse - _finite(merged))[..., None]
                    )
                    lse[..., qs] = merged
                if arriving is not None:
                    block = arriving()
            flat = out.permute(2, 0, 1, 3).reshape(q.shape).to(q.dtype)
        return flat, lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        q, k, v, layout, ring, scale = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.layout, ctx.ring, ctx.scale = layout, ring, scale
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        layout: ContextLayout = ctx.layout
        ring: RingGroup = ctx.ring
        scale: float = ctx.scale
        with torch.autocast(q.device.type, enabled=False):
            kv_heads = k.shape[1]
            queries, d_out = _grouped(q, kv_heads), _grouped(grad, kv_heads)
            # D_i = sum_d dO_i * O_i, FlashAttention-2's row term of the softmax backward.
            row = (d_out * _grouped(out, kv_heads)).sum(-1)
            d_queries = torch.zeros_like(queries)
            block = [k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()]
            # The dK/dV of the block in hand, added to by every rank it visits, then sent on with it.
            d_block = [torch.zeros_like(t, dtype=torch.float32) for t in block]
            for step in range(ring.size):
                source = (ring.rank - step) % ring.size
                arriving = ring.exchange(block) if step < ring.size - 1 else None
                keys, values = (t.float() for t in block)
                d_keys, d_values = d_block
                for qs, ks, mask in _pairs(layout, ring.rank, source):
                    scores = _scores(queries[:, :, qs], keys[:, ks], mask, scale)
                    probs = torch.exp(scores - _finite(lse[..., qs])[..., None])
                    d_values[:, ks] += (probs.transpose(-1, -2) @ d_out[:, :, qs]).sum(1)
                    d_probs = d_out[:, :, qs] @ values[:, None, ks].transpose(-1, -2)
                    d_scores = probs * (d_probs - row[..., qs, None]) * scale
                    d_queries[:, :, qs] += d_scores @ keys[:, None, ks]
                    d_keys[:, ks] += (d_scores.transpose(-1, -2) @ queries[:, :, qs]).sum(1)
                if ring.size > 1:  # after the last step this brings this rank's own block's home
                    d_block = ring.exchange(d_block, first_tag=len(block))()
                if arriving is not None:
                    block = arriving()
            dq = d_queries.permute(2, 0, 1, 3).reshape(q.shape).to(q.dtype)
            dk, dv = (t.transpose(0, 1).to(k.dtype) for t in d_block)
        return dq, dk, dv, None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ContextLayout, ring: RingGroup, scale: float
) -> torch.Tensor:
    """Attention of this rank's tokens (q [N, heads, D], k and v [N, kv_heads, D], N = 2 x chunk, in
    `layout.indices(ring.rank)` order) over every rank's keys by `layout`'s rule; differentiable."""
    expected = 2 * layout.chunk
    if q.shape[0] != expected or k.shape[0] != expected or v.shape[0] != expected:
        raise ValueError(
            f"ring attention of {q.shape[0]} local tokens: the layout gives each rank {expected}"
        )
    if layout.ranks != ring.size:
        raise ValueError(f"a layout over {layout.ranks} ranks on a ring of {ring.size}")
    out: torch.Tensor = _RingAttention.apply(q, k, v, layout, ring, scale)[0]  # type: ignore[no-untyped-call]
    return out


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward is the identity: right when every rank computes the same loss
    from the sum, so the gradient of each rank's contribution is that loss's gradient of the sum."""

    @staticmethod
    def forward(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad, None


def token_logprobs(
    model: CausalLM,
    batch: DenseBatch,
    targets: Sequence[tuple[int, int]],
    temperature: float,
    ring: RingGroup,
) -> list[torch.Tensor]:
    """`dense.token_logprobs` of `batch` computed by the ranks of `ring` together, each holding only its
    layout's share of the tokens' activations; every rank gets every logprob (call it on every rank of
    the ring with the same arguments)."""
    if len(targets) != len(batch.columns):
        raise ValueError(f"{len(targets)} target ranges for {len(batch.columns)} sequences")
    device = batch.input_ids.device
    layout = ContextLayout.of(batch, ring.size)
    mine = layout.indices(ring.rank)
    real = mine < layout.tokens
    flat_ids = batch.input_ids.reshape(-1)
    flat_positions = batch.positions.reshape(-1)
    where = torch.where(real, mine, 0)  # padding tokens: token 0's id and position, seen by no one
    local = DenseBatch(
        flat_ids[where][None], flat_positions[where][None], batch.segments.new_zeros(1, 1), (), ()
    )
    attend = partial(_layer_attention, layout=layout, ring=ring)
    hidden = hidden_states(model, local, attend)[0]
    width = batch.input_ids.shape[1]
    sources: list[int] = []  # flat index of the token whose hidden state predicts each target
    wanted: list[int] = []
    for (row, located), (start, end) in zip(batch.columns, targets, strict=True):
        if not 1 <= start <= end <= len(located):
            raise ValueError(f"target range ({start}, {end}) outside a sequence of {len(located)} tokens")
        sources.extend(row * width + c for c in located[start - 1 : end - 1])
        wanted.extend(row * width + c for c in located[start:end])
    slot = torch.full((2 * layout.ranks * layout.chunk,), -1, dtype=torch.long, device=device)
    slot[mine] = torch.arange(mine.numel(), device=device)
    source_slots = slot[torch.tensor(sources, dtype=torch.long, device=device)]
    held = (source_slots >= 0).nonzero()[:, 0]  # the targets this rank scores
    tokens = flat_ids[torch.tensor(wanted, dtype=torch.long, device=device)[held]]
    scored = head_logprobs(model, hidden[source_slots[held]], tokens, temperature)
    share = scored.new_zeros(len(sources)).index_copy(0, held, scored)
    logprobs: torch.Tensor = _SumOverRanks.apply(share, ring.group)  # type: ignore[no-untyped-call]
    return list(torch.split(logprobs, [end - start for start, end in targets]))


def _layer_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, layout: ContextLayout, ring: RingGroup
) -> torch.Tensor:
    return ring_attention(q, k, v, layout, ring, scale)
