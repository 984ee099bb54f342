"""The only part of the engine that touches the device: it owns the model and the paged KV cache.

`make_batch` turns per-sequence chunks (new tokens, cached length, block table) into flat tensors;
`ModelRunner.run` maps them to logits. Which blocks a sequence owns is decided by the caller (the block
manager); `generate_greedy` carries its own trivial allocator only to serve tests and demos.

With `lanes` > 1, `ModelRunner.step` splits a step's sequences into that many contiguous groups and runs
one forward per group at once, on its own thread with its own share of torch's threads (data parallel
over the batch, weights and KV cache shared: each group writes only its own sequences' slots). The
default is one lane, each op split over the threads: on an idle 2-core machine that decoded SmolLM2
10-25% faster per step than two lanes (each lane reads every weight; one matmul of all rows reads it
once). Lanes are for cores shared with other work: with another process busy on one core, a 64-sequence
step took 281 ms split per op (every parallel region waits for the descheduled thread) and 148 ms in two
lanes (one wait per step); `governor.ThreadGovernor` instead gives the busy core up (130 ms).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tether.kernels.attention import AttentionMetadata, SequenceSpan
from tether.kernels.blockwise import LongChunkAttention
from tether.kernels.kv_cache import KVCache
from tether.models.config import ModelConfig
from tether.models.governor import ThreadGovernor
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


# A lane must have this many new tokens to be worth a thread of its own: below it the step is bound by
# reading the weights, which two lanes would each read.
MIN_LANE_TOKENS = 4


def split_lanes(
    chunks: Sequence[SequenceChunk], lanes: int, min_tokens: int = MIN_LANE_TOKENS
) -> list[list[SequenceChunk]]:
    """Contiguous groups of chunks with about equal new tokens, at most `lanes`, each of at least
    `min_tokens` tokens (one group when the step is too small to share); order is kept, so the
    groups' logits concatenated are the step's logits in order."""
    total = sum(len(chunk.token_ids) for chunk in chunks)
    count = max(1, min(lanes, len(chunks), total // min_tokens))
    groups: list[list[SequenceChunk]] = [[] for _ in range(count)]
    seen = 0
    for chunk in chunks:
        # The group of a chunk is where its middle token falls, so one long prefill is not split from
        # its neighbours arbitrarily and each group ends up near total / count tokens.
        middle = seen + len(chunk.token_ids) / 2
        groups[min(int(middle * count / total), count - 1)].append(chunk)
        seen += len(chunk.token_ids)
    return [group for group in groups if group]


class WeightUpdateError(ValueError):
    """A hot weight update names an unknown parameter or has the wrong shape."""


def make_batch(
    chunks: Iterable[SequenceChunk],
    block_size: int,
    device: torch.device | str,
    windows: Iterable[int | None] = (None,),
    long_chunks: LongChunkAttention | None = None,
) -> Batch:
    """The flat tensors of a step; attention metadata for each distinct layer window in `windows`."""
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

    metadata = AttentionMetadata.build(spans, tensor(slots), block_size, windows, long_chunks)
    return Batch(tensor(ids), tensor(positions), metadata, tensor(logits_indices))


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype | None = None,
        lanes: int = 1,
    ) -> None:
        self.model = model
        model.cache_packed_weights(True)  # the runner writes weights only through `update_weights`
        # The parameters `update_weights` has moved into this process's memory (by id): `load` maps the
        # checkpoint's file privately, and writing such a page in place copies it first, page by page
        # (SmolLM2's first weight push 1.55 s, the next ones 0.05 s).
        self._owned: set[int] = set()
        self.config: ModelConfig = model.config
        parameter = next(model.parameters())
        self.device = parameter.device
        self.block_size = block_size
        self.kv_cache = KVCache.allocate(
            self.config, num_blocks, block_size, device=self.device, dtype=kv_dtype or parameter.dtype
        )
        self._pool: ThreadPoolExecutor | None = None
        self.lanes = 1
        self.set_lanes(lanes)
        self.governor: ThreadGovernor | None = None
        """Moves torch's thread count with the free cores before each step, when set."""
        self.long_chunks = LongChunkAttention()
        """How chunks with a long context attend (the engine sets it from `EngineConfig`)."""

    def set_lanes(self, lanes: int) -> None:
        """Forwards run at once per step (see the module docstring); 1 runs the whole step as one."""
        if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
            raise ValueError(f"lanes must be an integer of at least 1, got {lanes!r}")
        if self.device.type != "cpu" and lanes > 1:
            raise ValueError(f"lanes > 1 splits CPU cores between forwards; the model is on {self.device}")
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self.lanes = lanes
        if lanes > 1:
            self._pool = ThreadPoolExecutor(lanes - 1, thread_name_prefix="tether-lane")

    def make_batch(self, chunks: Iterable[SequenceChunk]) -> Batch:
        """`make_batch` for this runner's cache, layer windows and long-chunk attention."""
        return make_batch(chunks, self.block_size, self.device, self.config.layer_windows, self.long_chunks)

    def close(self) -> None:
        self.set_lanes(1)

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in float32; writes the batch's K/V into the cache."""
        logits: torch.Tensor = self.model(
            batch.input_ids, batch.positions, batch.attention, self.kv_cache, batch.logits_indices
        )
        return logits.float()

    def step(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        if self.governor is not None:
            self.governor.observe()
        if self._pool is None:
            return self.run(self.make_batch(chunks))
        # A batch-invariant model pads projections to `min_rows`: a lane with fewer would compute padding.
        groups = split_lanes(chunks, self.lanes, max(MIN_LANE_TOKENS, self.model.min_rows))
        if len(groups) == 1:
            return self.run(self.make_batch(chunks))
        batches = [self.make_batch(group) for group in groups]
        threads = torch.get_num_threads()
        share = max(1, threads // len(groups))

        def run_lane(batch: Batch) -> torch.Tensor:
            torch.set_num_threads(share)  # this thread's OpenMP team; the count itself is process-wide
            return self.run(batch)

        torch.set_num_threads(share)
        try:
            pending = [self._pool.submit(run_lane, batch) for batch in batches[1:]]
            first = self.run(batches[0])
            return torch.cat([first, *(future.result() for future in pending)])
        finally:
            torch.set_num_threads(threads)

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
            tokens = iter(self.greedy(self.make_batch(chunks)))
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
            return update_quantized_weights(self.model, named_tensors)  # in place: packed copies follow
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
            param = params[name]
            value = tensor.to(device=param.device, dtype=param.dtype)
            if param.device.type == "cpu" and id(param) not in self._owned:
                # new storage in the parameter's layout; packed copies key on the storage, so they rebuild
                param.data = torch.empty_like(param).copy_(value)
                self._owned.add(id(param))
            else:
                param.copy_(value)
        return len(items)
