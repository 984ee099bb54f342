"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, block tables and the prefix cache.

Plain Python over block ids: it never touches tensors (the model runner owns the KV memory and performs
the block copies returned here) and knows nothing about tokenization or scheduling policy.

Prefix cache: a full block whose KV has been computed is keyed by a chained hash of its whole token
prefix (`tether.block_hash`: blake2b-128 over the parent block's hash and this block's token ids). The
hash is stable across processes (the gateway's prefix-aware routing computes the same keys); a collision
would need about 2**64 work, and a hit also compares the block's token ids, so a cached block is only
reused for the same prefix. Blocks nobody
references keep their KV and stay findable in an LRU pool until a fresh block is needed and the free
list is empty.

Lower tiers (`kv_tiers.py`): with `record_evictions` on, every cached block evicted from that pool is
reported (`take_evicted`) so its KV can be copied out before the block is written again, so is every
block that enters the cache from a computation (`take_newly_cached`, for a write-through disk tier), and
blocks brought back from a lower tier re-enter the cache through `import_cached_blocks`.

Sliding windows: when every layer of the model slides, `release_behind_window` gives back the blocks wholly
before the window of a sequence's next token. Its table keeps its positional layout (block i holds
positions i * block_size ..): a released entry becomes `NO_BLOCK`, which attention never reads.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from tether.block_hash import BlockHash, hash_block
from tether.engine.config import EngineConfig
from tether.engine.sequence import Sequence

NO_BLOCK = -1
"""A block-table entry whose block was released because it fell behind the sliding window."""

BlockCopy = tuple[int, int]
"""(source block id, destination block id): copy the source's KV into the destination before the step."""


def slot_mapping(block_table: Seq[int], block_size: int, start: int, num_tokens: int) -> list[int]:
    """The flat KV slot (block_id * block_size + offset) of positions [start, start + num_tokens)."""
    assert start + num_tokens <= len(block_table) * block_size, "positions beyond the block table"
    return [
        block_table[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)
    ]


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """A prefix-cache block: its KV (in `block_id`) belongs to the prefix `hash`, whose last block's
    tokens are `token_ids`. Reported when it enters the cache and when it is evicted (then its KV stays
    in `block_id` until the step that reuses the block writes)."""

    block_id: int
    hash: BlockHash
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockManagerStats:
    num_blocks: int
    num_used_blocks: int
    """Blocks referenced by at least one sequence."""
    num_free_blocks: int
    """Blocks that can be handed out, cached but unreferenced ones included."""
    num_cached_blocks: int
    """Blocks findable in the prefix cache, referenced or not."""
    prefix_cache_queries: int
    """Tokens of sequences looked up in the prefix cache when they were (re)admitted."""
    prefix_cache_hits: int
    """Of those, tokens whose KV was found."""
    window_released_blocks: int = 0
    """Blocks given back because they fell wholly behind every layer's sliding window."""

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class _Block:
    __slots__ = ("block_id", "hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, LRU first
        self._cached: dict[BlockHash, int] = {}
        # Per sequence: hashes of its full blocks, how many of its blocks were offered to the cache, and
        # the cache epoch its KV was computed in (KV from before `invalidate_prefix_cache` is never cached).
        self._hashes: dict[int, list[BlockHash]] = {}
        self._num_offered: dict[int, int] = {}
        self._seq_epoch: dict[int, int] = {}
        self._epoch = 0
        self._queries = 0
        self._hits = 0
        self.record_evictions = False
        """Report evicted and newly cached blocks (`take_evicted`, `take_newly_cached`): lower tiers keep
        their KV."""
        self._evicted: list[CachedBlock] = []
        self._newly_cached: list[CachedBlock] = []
        self._window_released = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> BlockManager:
        return cls(config.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def is_cached(self, block_id: int) -> bool:
        """Whether the block is findable in the prefix cache."""
        return self._blocks[block_id].hash is not None

    def stats(self) -> BlockManagerStats:
        return BlockManagerStats(
            num_blocks=self.num_blocks,
            num_used_blocks=self.num_used_blocks,
            num_free_blocks=self.num_free_blocks,
            num_cached_blocks=len(self._cached),
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            window_released_blocks=self._window_released,
        )

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the KV of `seq`'s leading full blocks; does not change anything.

        Only for a sequence holding no blocks. The block holding the last token is never matched: the
        model must compute that token to produce logits.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        size = self.block_size
        found: list[int] = []
        for i, block_hash in enumerate(self._block_hashes(seq, (seq.num_tokens - 1) // size)):
            block_id = self._cached.get(block_hash)
            if block_id is None or self._blocks[block_id].token_ids != tuple(
                seq.token_ids[i * size : (i + 1) * size]
            ):
                break
            found.append(block_id)
        return found

    def prompt_block_hashes(self, seq: Sequence, first: int) -> list[BlockHash]:
        """Hashes of `seq`'s full prompt blocks from index `first` on: the blocks a prefill will offer to
        the prefix cache (the block holding the last prompt token never is: its logits are needed)."""
        if not self.enable_prefix_caching:
            return []
        return self._block_hashes(seq, (seq.num_prompt_tokens - 1) // self.block_size)[first:]

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: Seq[int] = ()) -> bool:
        """Whether `allocate(seq, num_new_tokens, prefix)` would find enough blocks."""
        return self._blocks_needed(seq, num_new_tokens, prefix) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: Seq[int] = ()) -> list[BlockCopy]:
        """Give `seq` slots for its next `num_new_tokens` tokens after `num_computed_tokens`.

        `prefix` (from `find_cached_prefix`, only for a sequence holding no blocks) is attached first and
        `seq.num_computed_tokens` advanced past it. A shared, partly filled block about to be written is
        copied first (copy-on-write); the returned copies must run before the step's forward pass.
        """
        assert self.can_allocate(seq, num_new_tokens, prefix), "allocate without can_allocate"
        table = seq.block_table
        if not table:
            assert seq.num_computed_tokens == 0, "a sequence without blocks has no KV"
            for block_id in prefix:
                self._ref(block_id)
            table.extend(prefix)
            cached_tokens = len(prefix) * self.block_size
            seq.num_computed_tokens = cached_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = min(cached_tokens, seq.num_prompt_tokens)
            if self.enable_prefix_caching:
                self._queries += seq.num_tokens
                self._hits += cached_tokens
            self._seq_epoch[seq.seq_id] = self._epoch
        else:
            assert not prefix, "a prefix only attaches to a sequence without blocks"
        copies: list[BlockCopy] = []
        index = seq.num_computed_tokens // self.block_size
        if num_new_tokens > 0 and index < len(table) and self._blocks[table[index]].ref_count > 1:
            source = self._blocks[table[index]]
            assert source.hash is None, "a cached block is full and never written again"
            source.ref_count -= 1
            table[index] = self._take_block()
            copies.append((source.block_id, table[index]))
        while len(table) * self.block_size < seq.num_computed_tokens + num_new_tokens:
            table.append(self._take_block())
        return copies

    def append_slot(self, seq: Sequence) -> list[BlockCopy]:
        """Slots for one decode token: `allocate(seq, 1)`."""
        return self.allocate(seq, 1)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer `seq`'s full, computed blocks to the prefix cache; call after the step computed them."""
        if not self.enable_prefix_caching or self._seq_epoch.get(seq.seq_id) != self._epoch:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = self._num_offered.get(seq.seq_id, 0)
        hashes = self._block_hashes(seq, num_full)
        for i in range(start, num_full):
            if seq.block_table[i] == NO_BLOCK:
                continue
            block = self._blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self._cached:
                block.hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                self._cached[hashes[i]] = block.block_id
                if self.record_evictions:
                    self._newly_cached.append(CachedBlock(block.block_id, block.hash, block.token_ids))
        self._num_offered[seq.seq_id] = max(start, num_full)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the KV of `seq`'s first `num_tokens` positions: release the blocks past them.

        For rejected speculative tokens: call after lowering `seq.num_computed_tokens` to `num_tokens` and
        before `cache_full_blocks`, so that no block holding a rejected token's KV is ever offered.
        """
        assert seq.num_computed_tokens <= num_tokens, "trim below the computed tokens"
        keep = -(-num_tokens // self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            self._unref(block_id)
        del seq.block_table[keep:]
        num_full = num_tokens // self.block_size
        if seq.seq_id in self._hashes:
            del self._hashes[seq.seq_id][num_full:]
        if seq.seq_id in self._num_offered:
            self._num_offered[seq.seq_id] = min(self._num_offered[seq.seq_id], num_full)

    def release_behind_window(self, seq: Sequence, window: int) -> int:
        """Give back `seq`'s blocks that hold only positions before `num_computed_tokens - window + 1`, the
        first its next token sees through a `window`-token sliding window (later tokens, and a rollback of
        drafts, which never goes below the last chunk's start, see no earlier ones). Cached blocks stay
        findable. Returns how many were released."""
        behind = max(0, seq.num_computed_tokens - window + 1) // self.block_size
        released = 0
        for i in range(min(behind, len(seq.block_table))):
            if seq.block_table[i] != NO_BLOCK:
                self._unref(seq.block_table[i])
                seq.block_table[i] = NO_BLOCK
                released += 1
        self._window_released += released
        return released

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share all of `parent`'s blocks (a later write to a shared block copies it)."""
        assert not child.block_table, "the child of a fork holds no blocks yet"
        for block_id in parent.block_table:
            if block_id != NO_BLOCK:
                self._ref(block_id)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        if parent.seq_id in self._hashes:
            self._hashes[child.seq_id] = list(self._hashes[parent.seq_id])
        self._num_offered[child.seq_id] = self._num_offered.get(parent.seq_id, 0)
        self._seq_epoch[child.seq_id] = self._seq_epoch.get(parent.seq_id, self._epoch)

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; cached ones stay findable. Last blocks first, so they are evicted first."""
        for block_id in reversed(seq.block_table):
            if block_id != NO_BLOCK:
                self._unref(block_id)
        seq.block_table = []
        self._hashes.pop(seq.seq_id, None)
        self._num_offered.pop(seq.seq_id, None)
        self._seq_epoch.pop(seq.seq_id, None)

    def invalidate_prefix_cache(self) -> int:
        """Forget every cached prefix (after a weight update); returns how many blocks were forgotten.

        KV computed before the call is never cached afterwards, even when its sequence completes a block.
        """
        for block_id in self._cached.values():
            block = self._blocks[block_id]
            block.hash = None
            block.token_ids = ()
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._evicted.clear()  # KV of the old weights: not worth keeping
        self._newly_cached.clear()
        forgotten = len(self._cached)
        self._cached.clear()
        self._epoch += 1
        return forgotten

    def take_evicted(self) -> list[CachedBlock]:
        """Cached blocks evicted since the last call, oldest first; their KV must be read before the
        step's copies and forward pass write into them."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def take_newly_cached(self) -> list[CachedBlock]:
        """Blocks that computations added to the prefix cache since the last call and that still hold
        that KV (read them before the next step's writes)."""
        fresh, self._newly_cached = self._newly_cached, []
        return [b for b in fresh if self._blocks[b.block_id].hash == b.hash]

    def cached_block_id(self, block_hash: BlockHash) -> int | None:
        """The device block holding the prefix `block_hash`, if cached."""
        return self._cached.get(block_hash)

    def uncached_block_keys(self, seq: Sequence, first: int) -> list[tuple[BlockHash, tuple[int, ...]]]:
        """(hash, token ids) of `seq`'s full blocks from index `first` up to, not including, the block
        holding its last token: what a lower tier could supply after a device prefix of `first` blocks."""
        size = self.block_size
        hashes = self._block_hashes(seq, (seq.num_tokens - 1) // size)
        return [
            (hashes[i], tuple(seq.token_ids[i * size : (i + 1) * size])) for i in range(first, len(hashes))
        ]

    def import_cached_blocks(
        self, keep: Seq[int], keys: Seq[tuple[BlockHash, tuple[int, ...]]]
    ) -> dict[int, int]:
        """Blocks to hold KV brought back from a lower tier, already findable in the prefix cache under
        `keys` and unreferenced (the most recently used of the pool): the caller must fill them before the
        next step's forward pass. The cached blocks `keep` (the device prefix in front of them) are marked
        recently used first so that taking blocks does not evict them. At most `num_free_blocks` less the
        unreferenced blocks of `keep`; keys already cached are skipped. Returns key index -> block id."""
        for block_id in keep:
            if block_id in self._evictable:
                self._evictable.move_to_end(block_id)
        room = self.num_free_blocks - sum(b in self._evictable for b in keep)
        imported: dict[int, int] = {}
        for index, (block_hash, token_ids) in enumerate(keys[: max(0, room)]):
            if block_hash in self._cached:
                continue
            block = self._blocks[self._take_block()]
            block.ref_count = 0
            block.hash = block_hash
            block.token_ids = token_ids
            self._cached[block_hash] = block.block_id
            self._evictable[block.block_id] = None
            imported[index] = block.block_id
        return imported

    def allocate_restored(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Fresh blocks for the first `num_tokens` positions of a sequence holding none, whose KV the
        caller copies in (a swapped-out sequence coming back); marks them computed."""
        assert not seq.block_table and seq.num_computed_tokens == 0, "restore into a sequence with blocks"
        assert self._blocks_needed(seq, num_tokens, ()) <= self.num_free_blocks, "restore without room"
        seq.block_table = [self._take_block() for _ in range(-(-num_tokens // self.block_size))]
        seq.num_computed_tokens = num_tokens
        self._seq_epoch[seq.seq_id] = self._epoch
        return list(seq.block_table)

    def slot_mapping(self, seq: Sequence, start: int, num_tokens: int) -> list[int]:
        """The flat KV slot (block_id * block_size + offset) of positions [start, start + num_tokens)."""
        return slot_mapping(seq.block_table, self.block_size, start, num_tokens)

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int, prefix: Seq[int]) -> int:
        held = len(seq.block_table) + len(prefix)
        computed = seq.num_computed_tokens + len(prefix) * self.block_size
        needed = max(0, -(-(computed + num_new_tokens) // self.block_size) - held)
        index = seq.num_computed_tokens // self.block_size
        if num_new_tokens > 0 and index < len(seq.block_table):
            needed += self._blocks[seq.block_table[index]].ref_count > 1  # copy-on-write
        # Unreferenced cached blocks count as free; attaching them takes them from the pool.
        return needed + sum(self._blocks[b].ref_count == 0 for b in prefix)

    def _block_hashes(self, seq: Sequence, count: int) -> list[BlockHash]:
        hashes = self._hashes.setdefault(seq.seq_id, [])
        size = self.block_size
        while len(hashes) < count:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, seq.token_ids[i * size : (i + 1) * size]))
        return hashes[:count]

    def _ref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed more often than referenced"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def _take_block(self) -> int:
        if self._free:
            block = self._blocks[self._free.popleft()]
        else:
            block = self._blocks[self._evictable.popitem(last=False)[0]]
            assert block.hash is not None
            del self._cached[block.hash]
            if self.record_evictions:
                self._evicted.append(CachedBlock(block.block_id, block.hash, block.token_ids))
            block.hash = None
            block.token_ids = ()
        assert block.ref_count == 0
        block.ref_count = 1
        return block.block_id
