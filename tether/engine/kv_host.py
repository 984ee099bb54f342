"""The host tier's memory: block slots in host memory (pinned on CUDA), laid out like the device cache.

Two kinds of occupants: prefix-cache blocks, in LRU order and evictable (`take` hands back the evicted
ones so their KV can move to the disk tier first), and the blocks of swapped-out sequences, which stay
until the sequence is swapped back in or finishes. Bookkeeping and storage only; the copies between
tiers are `kv_tiers.py`'s.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from tether.block_hash import BlockHash
from tether.kernels.kv_cache import KVCache

BlockKey = tuple[BlockHash, tuple[int, ...]]
"""A prefix block's chained hash and its own token ids (checked on every hit)."""


class HostBlockPool:
    """Block slots in host memory: prefix blocks in LRU order (evictable) and swapped sequences' blocks."""

    def __init__(self, capacity_blocks: int, cache: KVCache, pin: bool) -> None:
        shape = (capacity_blocks, *cache.keys[0].shape[1:])
        dtype = cache.keys[0].dtype
        # Zeroed now so that the first offload does not pay for faulting the pages in.
        self.tensors = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(2 * cache.num_layers)]
        """Per layer K then V, as `KVCache.gather_blocks` orders them."""
        self.capacity_blocks = capacity_blocks
        self._free = list(range(capacity_blocks))
        self._prefix: OrderedDict[BlockHash, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._swaps: dict[int, list[int]] = {}
        self._reserved: dict[int, int] = {}  # seq_id -> slots promised to a swap-out not yet performed

    @property
    def num_used(self) -> int:
        return self.capacity_blocks - len(self._free)

    @property
    def room(self) -> int:
        """Slots a new swap-out can still have (evicting prefix blocks)."""
        return len(self._free) + len(self._prefix) - sum(self._reserved.values())

    def find(self, key: BlockKey) -> int | None:
        entry = self._prefix.get(key[0])
        if entry is None or entry[1] != key[1]:
            return None
        self._prefix.move_to_end(key[0])
        return entry[0]

    def take(self, count: int) -> tuple[list[int], list[tuple[BlockKey, int]]]:
        """`count` slots, evicting least recently used prefix blocks: returns the slots and the evicted
        blocks (key, slot), whose KV must be read (for the disk tier) before the slots are written."""
        assert count <= len(self._free) + len(self._prefix)
        slots = self._free[:count]
        del self._free[:count]
        evicted = []
        while len(slots) < count:
            block_hash, (slot, token_ids) = self._prefix.popitem(last=False)
            evicted.append(((block_hash, token_ids), slot))
            slots.append(slot)
        return slots, evicted

    def add_prefix(self, key: BlockKey, slot: int) -> None:
        self._prefix[key[0]] = (slot, key[1])

    def reserve(self, seq_id: int, count: int) -> bool:
        if count > self.room:
            return False
        self._reserved[seq_id] = count
        return True

    def hold_swap(self, seq_id: int) -> tuple[list[int], list[tuple[BlockKey, int]]]:
        slots, evicted = self.take(self._reserved.pop(seq_id))
        self._swaps[seq_id] = slots
        return slots, evicted

    def release_swap(self, seq_id: int) -> list[int]:
        slots = self._swaps.pop(seq_id, [])
        self._reserved.pop(seq_id, None)
        self._free.extend(slots)
        return slots

    def clear(self) -> None:
        self._free = list(range(self.capacity_blocks))
        self._prefix.clear()
        self._swaps.clear()
        self._reserved.clear()
