"""KV memory tiers below the device cache: host memory, then the disk store (`kv_disk.py`).

Prefix-cache blocks the block manager evicts are copied to the host tier (pinned memory on CUDA) before
the step that reuses them writes; when the host tier is full its least recently used blocks move to the
disk tier (straight there without a host tier). Before each step, a waiting sequence whose prefix blocks
are found below the device gets them copied back into fresh device blocks when that is cheaper than
prefilling them (`swap_cost.restore_is_cheaper`, with the tier bandwidths and the prefill rate measured
as the engine runs); the admission then finds them in the prefix cache. The host tier also holds the KV
of sequences preempted by swapping, which is never evicted. Copies are batched: one index_select /
index_copy_ per layer tensor for all the blocks of a step. Drives the model runner's KV cache; knows
nothing about scheduling policy beyond the `SchedulerOutput` it applies.

The disk tier is written through: every block a step adds to the prefix cache is written after the step
(synchronously, in the engine loop), so a restarted engine finds what the last one computed even after a
crash. A weight update empties the host tier and moves the disk tier to the new weights' folder, which
costs one hash of the weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from tether.block_hash import BlockHash
from tether.engine.block_manager import BlockManager, CachedBlock
from tether.engine.config import EngineConfig, PreemptionMode
from tether.engine.kv_disk import DiskBlockStore, model_fingerprint
from tether.engine.kv_host import BlockKey, HostBlockPool
from tether.engine.scheduler import Scheduler, SchedulerOutput
from tether.engine.sequence import Sequence, SequenceStatus
from tether.engine.swap_cost import (
    PRIOR_BYTES_PER_S,
    PRIOR_PREFILL_TOKENS_PER_S,
    RateMeter,
    Rates,
    Tier,
    choose_preemption,
    restore_is_cheaper,
)
from tether.errors import ConfigError
from tether.kernels.kv_cache import KVCache

MIN_MEASURED_PREFILL_TOKENS = 16


@dataclass(frozen=True, slots=True)
class KVTierStats:
    """Counters since the engine started; tokens and bytes as each name says."""

    device_hit_tokens: int = 0
    """Prompt tokens found in the device prefix cache, not counting those just brought back."""
    host_hit_tokens: int = 0
    """Tokens whose KV was copied back from the host tier instead of computed."""
    disk_hit_tokens: int = 0
    host_bytes_in: int = 0
    """Host tier to device (restores, swap-ins)."""
    host_bytes_out: int = 0
    """Device to host tier (evicted blocks, swap-outs)."""
    disk_bytes_in: int = 0
    """Read from the disk tier."""
    disk_bytes_out: int = 0
    """Written to the disk tier."""
    recomputed_tokens: int = 0
    """Tokens computed again although their KV had been computed: dropped by preemption or a weight
    update, or found in a lower tier where the cost model said recomputing is cheaper."""
    swap_preemptions: int = 0
    recompute_preemptions: int = 0
    host_blocks: int = 0
    """Blocks held in the host tier now (swapped sequences included)."""
    host_capacity_blocks: int = 0
    disk_blocks: int = 0
    prefill_tokens_per_s: float = 0.0
    """The measured rates the cost model uses now."""
    host_bytes_per_s: float = 0.0
    disk_bytes_per_s: float = 0.0


_COUNTERS = (
    "host_hit_tokens",
    "disk_hit_tokens",
    "host_bytes_in",
    "host_bytes_out",
    "disk_bytes_in",
    "disk_bytes_out",
    "recomputed_tokens",
)


class KVTiers:
    @classmethod
    def for_engine(
        cls,
        config: EngineConfig,
        cache: KVCache,
        block_manager: BlockManager,
        model_config: object,
        parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    ) -> KVTiers | None:
        """The tiers `config` asks for (None for none); `parameters` gives the weights to fingerprint."""
        if not config.kv_host_tier_mib and config.kv_disk_tier_dir is None:
            return None
        fingerprint = None
        if config.kv_disk_tier_dir is not None:
            dtype = cache.keys[0].dtype
            fingerprint = model_fingerprint(model_config, dtype, config.block_size, parameters())
        return cls(config, cache, block_manager, model_config, fingerprint)

    def __init__(
        self,
        config: EngineConfig,
        cache: KVCache,
        block_manager: BlockManager,
        model_config: object,
        disk_fingerprint: str | None = None,
    ) -> None:
        """`disk_fingerprint` (`kv_disk.model_fingerprint`) names the model's folder in the disk tier."""
        self.config = config
        self.model_config = model_config
        self.cache = cache
        self.block_manager = block_manager
        block_manager.record_evictions = True
        self.block_bytes = cache.nbytes() // cache.num_blocks
        device = cache.keys[0].device
        self._sync = device.type == "cuda"
        self.host: HostBlockPool | None = None
        if config.kv_host_tier_mib:
            capacity = config.kv_host_tier_mib * 2**20 // self.block_bytes
            if capacity < 1:
                raise ConfigError(
                    f"engine: kv_host_tier_mib = {config.kv_host_tier_mib} holds no KV block "
                    f"({self.block_bytes / 2**20:.2f} MiB each): expected more"
                )
            self.host = HostBlockPool(capacity, cache, pin=self._sync)
        self.disk: DiskBlockStore | None = None
        if config.kv_disk_tier_dir is not None:
            assert disk_fingerprint is not None, "a disk tier needs the model's fingerprint"
            self.disk = DiskBlockStore(
                Path(config.kv_disk_tier_dir),
                disk_fingerprint,
                config.kv_disk_tier_mib * 2**20,
                (2 * cache.num_layers, *cache.keys[0].shape[1:]),
                cache.keys[0].dtype,
            )
        self.prefill_rate = RateMeter(PRIOR_PREFILL_TOKENS_PER_S.get(device.type, 2_000.0))
        self.host_rate = RateMeter(PRIOR_BYTES_PER_S[Tier.HOST])
        self.disk_rate = RateMeter(PRIOR_BYTES_PER_S[Tier.DISK])
        self._counts = dict.fromkeys(_COUNTERS, 0)
        # (seq_id, preemptions) of the waiting sequences whose lower-tier prefix was already decided
        self._looked: set[tuple[int, int]] = set()

    @property
    def rates(self) -> Rates:
        return Rates(self.prefill_rate.rate, self.host_rate.rate, self.disk_rate.rate)

    def choose_preemption(self, seq_id: int, num_blocks: int, num_tokens: int) -> PreemptionMode:
        """The scheduler's `PreemptionChooser`: swap when the mode and the cost model say so and the
        host tier has room (which is then promised to the sequence)."""
        mode = choose_preemption(
            self.config.preemption, num_blocks * self.block_bytes, num_tokens, self.rates
        )
        if mode is PreemptionMode.SWAP and self.host is not None and self.host.reserve(seq_id, num_blocks):
            return PreemptionMode.SWAP
        return PreemptionMode.RECOMPUTE

    def observe_step(self, plan: SchedulerOutput, logits: torch.Tensor, seconds: float) -> None:
        """Measure the prefill rate from a forward pass (giving `logits`) that took `seconds`: only from
        steps mostly made of prefill chunks (decode steps are bound by reading the weights instead)."""
        prefill = sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1 + len(c.draft_token_ids))
        if prefill < MIN_MEASURED_PREFILL_TOKENS or 2 * prefill < plan.num_batched_tokens:
            return
        if self._sync:
            started = time.perf_counter()
            torch.cuda.synchronize(logits.device)  # the forward pass ran asynchronously
            seconds += time.perf_counter() - started
        self.prefill_rate.observe(prefill, seconds)

    def promote(self, waiting: Iterable[Sequence]) -> None:
        """Bring back, before the step, the lower-tier prefix blocks of waiting sequences (most important
        first) where that beats recomputing them, into fresh device blocks left in the prefix cache."""
        order = sorted(waiting, key=lambda s: (-s.priority, s.arrival))
        self._looked &= {(s.seq_id, s.num_preemptions) for s in order}
        for seq in order[: self.config.max_num_seqs]:
            if seq.status is SequenceStatus.SWAPPED or (seq.seq_id, seq.num_preemptions) in self._looked:
                continue
            self._looked.add((seq.seq_id, seq.num_preemptions))
            device = self.block_manager.find_cached_prefix(seq)
            found = self._locate(self.block_manager.uncached_block_keys(seq, len(device)))
            if not found:
                continue
            by_tier: dict[Tier, int] = {}
            for tier, _, _ in found:
                if tier is not Tier.DEVICE:
                    by_tier[tier] = by_tier.get(tier, 0) + self.block_bytes
            num_tokens = sum(tier is not Tier.DEVICE for tier, _, _ in found) * self.config.block_size
            if not restore_is_cheaper(by_tier, num_tokens, self.rates):
                self._counts["recomputed_tokens"] += num_tokens
                continue
            if not self._restore(device, found):
                break  # the device is full: later sequences would evict these blocks

    def _locate(self, keys: list[BlockKey]) -> list[tuple[Tier, BlockKey, int | None]]:
        """The leading keys found in some tier: (tier, key, host slot or None). Disk blocks are only
        looked up in the store's index here; `_read_disk` reads and checks them."""
        found: list[tuple[Tier, BlockKey, int | None]] = []
        for key in keys:
            if self.block_manager.cached_block_id(key[0]) is not None:
                found.append((Tier.DEVICE, key, None))
                continue
            slot = None if self.host is None else self.host.find(key)
            if slot is not None:
                found.append((Tier.HOST, key, slot))
            elif self.disk is not None and key[0] in self.disk:
                found.append((Tier.DISK, key, None))
            else:
                break
        while found and found[-1][0] is Tier.DEVICE:
            found.pop()
        return found

    def _read_disk(
        self, found: list[tuple[Tier, BlockKey, int | None]]
    ) -> tuple[list[tuple[Tier, BlockKey, int | None]], torch.Tensor]:
        """Read the found disk blocks, in order, straight into one staging tensor [blocks, *block_shape];
        the chain ends before the first block whose file is damaged or gone (a miss)."""
        disk = self.disk
        rows = [i for i, (tier, _, _) in enumerate(found) if tier is Tier.DISK]
        if disk is None or not rows:
            return found, torch.empty(0)
        staging = torch.empty((len(rows), *disk.block_shape), dtype=disk.dtype)
        started = time.perf_counter()
        for row, index in enumerate(rows):
            if not disk.read_into(*found[index][1], staging[row]):
                found, staging = found[:index], staging[:row]
                break
        self.disk_rate.observe(len(staging) * disk.payload_bytes, time.perf_counter() - started)
        self._counts["disk_bytes_in"] += len(staging) * disk.payload_bytes
        return found, staging

    def _restore(self, device: list[int], found: list[tuple[Tier, BlockKey, int | None]]) -> bool:
        """Copy the found lower-tier blocks into fresh device blocks; False if not all fitted."""
        found, staging = self._read_disk(found)
        keep = list(device)
        for tier, key, _ in found:
            block_id = self.block_manager.cached_block_id(key[0]) if tier is Tier.DEVICE else None
            if block_id is not None:
                keep.append(block_id)
        wanted = [(tier, key, slot) for tier, key, slot in found if tier is not Tier.DEVICE]
        disk_rows: dict[BlockHash, int] = {}
        for tier, key, _ in wanted:
            if tier is Tier.DISK:
                disk_rows[key[0]] = len(disk_rows)
        imported = self.block_manager.import_cached_blocks(keep, [key for _, key, _ in wanted])
        host_ids, host_slots, disk_ids, rows = [], [], [], []
        for index, block_id in imported.items():
            tier, key, slot = wanted[index]
            if slot is not None:
                host_ids.append(block_id)
                host_slots.append(slot)
            else:
                disk_ids.append(block_id)
                rows.append(disk_rows[key[0]])
        # Read the host slots before offloading the blocks the import evicted: that may reuse them.
        from_host = self._from_host(host_slots) if host_ids else []
        self.apply_evictions()  # the blocks just taken hold evicted KV still to keep
        if host_ids:
            self._to_device(host_ids, from_host, Tier.HOST)
            self._counts["host_hit_tokens"] += len(host_ids) * self.config.block_size
        if disk_ids:
            picked = staging if len(rows) == len(staging) else staging[torch.tensor(rows)]
            self._to_device(disk_ids, list(picked.unbind(1)), Tier.DISK)
            self._counts["disk_hit_tokens"] += len(disk_ids) * self.config.block_size
        return len(imported) == len(wanted)

    def apply(self, plan: SchedulerOutput) -> None:
        """Perform a step's tier copies before its block copies and forward pass: swap-outs and evicted
        blocks out (their blocks may be written this step), then swap-ins."""
        for swap in plan.swap_out:
            assert self.host is not None
            slots, evicted = self.host.hold_swap(swap.seq_id)
            self._demote(evicted)
            self._to_host(swap.block_ids, slots)
        self.apply_evictions()
        for swap_in in plan.swap_in:
            assert self.host is not None
            slots = self.host.release_swap(swap_in.seq_id)
            self._to_device(swap_in.block_ids, self._from_host(slots), Tier.HOST)

    def apply_evictions(self) -> None:
        """Copy the prefix blocks the device evicted to the host tier (or the disk tier without one)."""
        evicted = self.block_manager.take_evicted()
        if not evicted:
            return
        if self.host is None:
            self._write_to_disk(evicted)
            return
        new = [e for e in evicted if self.host.find((e.hash, e.token_ids)) is None]
        fits = min(len(new), self.host.room)
        slots, demoted = self.host.take(fits)
        self._demote(demoted)
        self._to_host([e.block_id for e in new[:fits]], slots)
        for block, slot in zip(new[:fits], slots, strict=True):
            self.host.add_prefix((block.hash, block.token_ids), slot)
        self._write_to_disk(new[fits:])

    def persist_new_blocks(self) -> None:
        """Write the blocks the step added to the prefix cache through to the disk tier, so that they
        outlive the process (call after the step, before the next one can evict them)."""
        fresh = self.block_manager.take_newly_cached()
        if self.disk is not None:
            self._write_to_disk(fresh)

    def release_swap(self, seq_id: int) -> None:
        """Forget a finished or aborted sequence's swapped-out KV."""
        if self.host is not None:
            self.host.release_swap(seq_id)

    def invalidate(self, parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> None:
        """After a weight update: forget the host tier; the disk tier moves to the new weights' folder
        (`parameters` gives them, to fingerprint)."""
        if self.host is not None:
            self.host.clear()
        self._looked.clear()
        if self.disk is not None:
            fingerprint = model_fingerprint(
                self.model_config, self.disk.dtype, self.config.block_size, parameters()
            )
            self.disk = DiskBlockStore(
                self.disk.directory.parent,
                fingerprint,
                self.disk.capacity_bytes,
                self.disk.block_shape,
                self.disk.dtype,
            )

    def stats(
        self, device_hits: int, swaps: int, recompute_preemptions: int, dropped_tokens: int
    ) -> KVTierStats:
        """The counters, with the scheduler's preemptions and dropped tokens and the block manager's
        prefix hits (`device_hits` tokens, of which the restored ones are the tiers')."""
        counts = dict(self._counts)
        counts["recomputed_tokens"] += dropped_tokens
        restored = counts["host_hit_tokens"] + counts["disk_hit_tokens"]
        return KVTierStats(
            **counts,
            device_hit_tokens=max(0, device_hits - restored),
            swap_preemptions=swaps,
            recompute_preemptions=recompute_preemptions,
            host_blocks=0 if self.host is None else self.host.num_used,
            host_capacity_blocks=0 if self.host is None else self.host.capacity_blocks,
            disk_blocks=0 if self.disk is None else len(self.disk),
            prefill_tokens_per_s=self.prefill_rate.rate,
            host_bytes_per_s=self.host_rate.rate,
            disk_bytes_per_s=self.disk_rate.rate,
        )

    def _from_host(self, slots: list[int]) -> list[torch.Tensor]:
        assert self.host is not None
        index = torch.tensor(slots, dtype=torch.long)
        return [t.index_select(0, index) for t in self.host.tensors]

    def _to_host(self, block_ids: list[int], slots: list[int]) -> None:
        if not block_ids:
            return
        assert self.host is not None
        started = time.perf_counter()
        index = torch.tensor(slots, dtype=torch.long)
        for target, source in zip(self.host.tensors, self.cache.gather_blocks(block_ids), strict=True):
            target.index_copy_(0, index, source.cpu())
        num_bytes = len(block_ids) * self.block_bytes
        self.host_rate.observe(num_bytes, time.perf_counter() - started)
        self._counts["host_bytes_out"] += num_bytes

    def _to_device(self, block_ids: list[int], blocks: list[torch.Tensor], tier: Tier) -> None:
        started = time.perf_counter()
        self.cache.scatter_blocks(block_ids, blocks)
        if self._sync:
            torch.cuda.synchronize()
        if tier is Tier.HOST:
            num_bytes = len(block_ids) * self.block_bytes
            self.host_rate.observe(num_bytes, time.perf_counter() - started)
            self._counts["host_bytes_in"] += num_bytes

    def _demote(self, evicted: list[tuple[BlockKey, int]]) -> None:
        """Write prefix blocks leaving the host tier to the disk tier (before their slots are reused)."""
        if self.disk is None or self.host is None or not evicted:
            return
        fresh = [(key, slot) for key, slot in evicted if key[0] not in self.disk]
        if fresh:
            payloads = _per_block(self.host.tensors, [slot for _, slot in fresh])
            for (key, _), payload in zip(fresh, payloads, strict=True):
                self._counts["disk_bytes_out"] += self.disk.write(*key, payload)

    def _write_to_disk(self, blocks: list[CachedBlock]) -> None:
        if self.disk is None or not blocks:
            return
        fresh = [b for b in blocks if b.hash not in self.disk]
        if fresh:
            payloads = _per_block([*self.cache.keys, *self.cache.values], [b.block_id for b in fresh])
            for block, payload in zip(fresh, payloads, strict=True):
                self._counts["disk_bytes_out"] += self.disk.write(block.hash, block.token_ids, payload)


def tier_stats(tiers: KVTiers | None, scheduler: Scheduler, device_hits: int) -> KVTierStats:
    """An engine's tier counters, also without tiers (then only device hits and recomputation)."""
    swaps = scheduler.num_swap_preemptions
    recompute_preemptions = scheduler.num_preemptions - swaps
    if tiers is None:
        return KVTierStats(
            device_hit_tokens=device_hits,
            recomputed_tokens=scheduler.num_recomputed_tokens,
            recompute_preemptions=recompute_preemptions,
        )
    return tiers.stats(device_hits, swaps, recompute_preemptions, scheduler.num_recomputed_tokens)


def _per_block(tensors: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """The blocks of per-layer K/V tensors (any device) as one CPU tensor [blocks, tensors, *block]:
    each block's payload contiguous, as the disk tier stores it; one gather per tensor."""
    index = torch.tensor(block_ids, dtype=torch.long, device=tensors[0].device)
    out = torch.empty((len(block_ids), len(tensors), *tensors[0].shape[1:]), dtype=tensors[0].dtype)
    for i, tensor in enumerate(tensors):
        out[:, i] = tensor.index_select(0, index).cpu()
    return out
