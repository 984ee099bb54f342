"""The only part of the engine that touches the device: it owns the model and the paged KV cache.

`make_batch` turns per-sequence chunks (new tokens, cached length, block table) into flat tensors;
`ModelRunner.run` maps them to logits. Which blocks a sequence owns is decided by the caller (the block
manager); `generate_greedy` carries its own trivial allocator only to serve tests and demos.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from tether.engine.attention import AttentionMetadata, SequenceSpan
from tether.engine.kv_cache import KVCache
from tether.models.config import ModelConfig
from tether.models.quantize import is_quantized, update_quantized_weights
from tether.models.transformer import CausalLM


@dataclass(frozen=True, slots=True)
class SequenceChunk:
    """New tokens of one sequence for one step."""

    token_ids: list[int]
    start: int  # tokens of this sequence already in the cache
    block_table: list[int]  # must cover start + len(token_ids) tokens
    needs_logits: bool = True  # False for a prefill chunk that is not the prompt's last
    all_logits: bool = False  # logits for every position (verifying speculative drafts), not only the last


@dataclass(frozen=True, slots=True)
class Batch:
    input_ids: torch.Tensor  # LongTensor[T]
    positions: torch.Tensor  # LongTensor[T]
    attention: AttentionMetadata
    logits_indices: (
        torch.Tensor
    )  # LongTensor[S]: last token of each chunk that needs logits (all for all_logits)


class WeightUpdateError(ValueError):
    """A hot weight update names an unknown parameter or has the wrong shape."""


def make_batch(chunks: Iterable[SequenceChunk], block_size: int, device: torch.device | str) -> Batch:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    spans: list[SequenceSpan] = []
    logits_indices: list[int] = []
    for chunk in chunks:
        assert chunk.token_ids, "a chunk needs at least one token"
        end = chunk.start + len(chunk.token_ids)
        assert len(chunk.block_table) * block_size >= end, "block table too short for the chunk"
        spans.append(SequenceSpan(len(ids), len(chunk.token_ids), chunk.start, chunk.block_table))
        for pos in range(chunk.start, end):
            positions.append(pos)
            slots.append(chunk.block_table[pos // block_size] * block_size + pos % block_size)
        ids.extend(chunk.token_ids)
        if chunk.all_logits:
            logits_indices.extend(range(len(ids) - len(chunk.token_ids), len(ids)))
        elif chunk.needs_logits:
            logits_indices.append(len(ids) - 1)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    metadata = AttentionMetadata.build(spans, tensor(slots), block_size)
    return Batch(tensor(ids), tensor(positions), metadata, tensor(logits_indices))


class ModelRunner:
    def __init__(
        self, model: CausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None
    ) -> None:
        self.model = model
        self.config: ModelConfig = model.config
        parameter = next(model.parameters())
        self.device = parameter.device
        self.block_size = block_size
        self.kv_cache = KVCache.allocate(
            self.config, num_blocks, block_size, device=self.device, dtype=kv_dtype or parameter.dtype
        )

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in float32; writes the batch's K/V into the cache."""
        logits: torch.Tensor = self.model(
            batch.input_ids, batch.positions, batch.attention, self.kv_cache, batch.logits_indices
        )
        return logits.float()

    def step(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        return self.run(make_batch(chunks, self.block_size, self.device))

    def greedy(self, batch: Batch) -> list[int]:
        return [int(t) for t in self.run(batch).argmax(dim=-1).tolist()]

    def generate_greedy(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        eos_token_ids: Iterable[int] = (),
        prefill_chunk: int | None = None,
    ) -> list[list[int]]:
        """Greedy continuations of all prompts, batched; blocks are handed out from the top, interleaved."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        stop = set(eos_token_ids)
        free = list(range(self.kv_cache.num_blocks))
        tables: list[list[int]] = [[] for _ in prompts]
        cached = [0] * len(prompts)
        outputs: list[list[int]] = [[] for _ in prompts]
        pending = [list(p) for p in prompts]  # tokens not yet in the cache
        live = set(range(len(prompts)))
        while live:
            chunks, order = [], []
            for i in sorted(live):
                take = len(pending[i]) if prefill_chunk is None else min(prefill_chunk, len(pending[i]))
                end = cached[i] + take
                while len(tables[i]) * self.block_size < end:
                    if not free:
                        raise RuntimeError(f"KV cache full ({self.kv_cache.num_blocks} blocks)")
                    tables[i].append(free.pop())
                last = take == len(pending[i])
                chunks.append(SequenceChunk(pending[i][:take], cached[i], list(tables[i]), needs_logits=last))
                order.append((i, take, last))
            tokens = iter(self.greedy(make_batch(chunks, self.block_size, self.device)))
            for i, take, last in order:
                cached[i] += take
                pending[i] = pending[i][take:]
                if not last:
                    continue
                token = next(tokens)
                outputs[i].append(token)
                pending[i] = [token]
                if token in stop or len(outputs[i]) >= max_new_tokens:
                    live.discard(i)
        return outputs

    @torch.no_grad()
    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> int:
        """Copy tensors into the live parameters in place; all are validated before any is copied."""
        if is_quantized(self.model):
            return update_quantized_weights(self.model, named_tensors)
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in items:
            if name not in params:
                close = [p for p in params if p.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]][:3]
                raise WeightUpdateError(
                    f"unknown parameter {name!r}; names look like {close or list(params)[:3]}"
                )
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise WeightUpdateError(
                    f"parameter {name!r} has shape {tuple(params[name].shape)}, got {tuple(tensor.shape)}"
                )
        for name, tensor in items:
            params[name].copy_(tensor.to(device=params[name].device, dtype=params[name].dtype))
        return len(items)
