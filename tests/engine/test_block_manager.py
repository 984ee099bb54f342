"""BlockManager: reference-counted blocks, prefix cache with LRU eviction, forks with copy-on-write."""

from __future__ import annotations

import pytest

from tether.engine import BlockManager, Sequence
from tether.engine import block_manager as block_manager_module


def computed(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> Sequence:
    """Allocate and "compute" `num_tokens` (default: all) of `seq`, as one step of the model would."""
    count = seq.num_uncomputed_tokens if num_tokens is None else num_tokens
    bm.allocate(seq, count)
    seq.num_computed_tokens += count
    bm.cache_full_blocks(seq)
    return seq


def admitted(bm: BlockManager, seq: Sequence) -> Sequence:
    """Attach the cached prefix of `seq` and compute the rest."""
    prefix = bm.find_cached_prefix(seq)
    rest = seq.num_tokens - len(prefix) * bm.block_size
    bm.allocate(seq, rest, prefix)
    seq.num_computed_tokens += rest
    bm.cache_full_blocks(seq)
    return seq


def test_allocation_takes_blocks_and_free_returns_them() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = computed(bm, Sequence(1, "r", range(10)))
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert all(bm.ref_count(b) == 1 for b in seq.block_table)
    assert (bm.num_used_blocks, bm.num_free_blocks) == (3, 5)
    bm.free(seq)
    assert seq.block_table == []
    assert (bm.num_used_blocks, bm.num_free_blocks) == (0, 8)


def test_slot_mapping_maps_positions_to_block_offsets() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(Sequence(0, "other", range(4)), 4)  # take block 0 so the sequence's blocks are not 0..
    seq = Sequence(1, "r", range(6))
    bm.allocate(seq, 6)
    first, second = seq.block_table
    assert bm.slot_mapping(seq, 2, 4) == [first * 4 + 2, first * 4 + 3, second * 4, second * 4 + 1]


def test_can_allocate_refuses_more_blocks_than_are_free() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = Sequence(1, "r", range(20))
    assert bm.can_allocate(seq, 12)
    assert not bm.can_allocate(seq, 13)


def test_prefix_cache_hit_reuses_blocks_and_reports_cached_tokens() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    first = computed(bm, Sequence(1, "a", [*range(10), 50]))
    second = Sequence(2, "b", [*range(10), 60, 61])
    prefix = bm.find_cached_prefix(second)
    assert prefix == first.block_table[:2]  # two full blocks in common; the third differs
    bm.allocate(second, second.num_tokens - 8, prefix)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert [bm.ref_count(b) for b in second.block_table] == [2, 2, 1]
    assert (second.num_computed_tokens, second.num_cached_tokens) == (8, 8)
    stats = bm.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (11 + 12, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 23)


@pytest.mark.parametrize(("prompt_len", "expected_hit"), [(8, 4), (9, 8), (12, 8), (13, 12), (3, 0)])
def test_last_prompt_token_is_always_computed(prompt_len: int, expected_hit: int) -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    computed(bm, Sequence(1, "a", range(prompt_len)))
    again = Sequence(2, "b", range(prompt_len))
    assert len(bm.find_cached_prefix(again)) * 4 == expected_hit
    admitted(bm, again)
    assert again.num_cached_tokens == expected_hit < prompt_len


def test_freed_cached_blocks_are_still_found() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    first = computed(bm, Sequence(1, "a", range(9)))
    cached = first.block_table[:2]
    bm.free(first)
    assert bm.num_used_blocks == 0 and bm.stats().num_cached_blocks == 2
    assert bm.find_cached_prefix(Sequence(2, "b", range(9))) == cached


def test_a_hash_collision_is_not_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_manager_module, "hash_block", lambda parent, tokens: b"same")
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, Sequence(1, "a", [1, 2, 3, 4, 5]))
    assert bm.find_cached_prefix(Sequence(2, "b", [9, 9, 9, 9, 5])) == []
    assert len(bm.find_cached_prefix(Sequence(3, "c", [1, 2, 3, 4, 6]))) == 1


def test_hash_chains_the_whole_prefix() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    computed(bm, Sequence(1, "a", [1, 2, 3, 4, 5]))
    # Same second block, different first block: the second block's KV differs, so nothing is reused.
    assert bm.find_cached_prefix(Sequence(2, "b", [9, 9, 3, 4, 5])) == []


def test_free_blocks_are_used_before_cached_ones_are_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    first = computed(bm, Sequence(1, "a", [1, 2, 3, 4, 5]))
    cached = first.block_table[:2]
    bm.free(first)
    other = Sequence(2, "b", [7, 7, 7])
    bm.allocate(other, 3)  # two blocks: the uncached free ones
    assert not set(other.block_table) & set(cached)
    assert bm.find_cached_prefix(Sequence(3, "c", [1, 2, 3, 4, 5])) == cached


def test_eviction_takes_a_sequences_last_block_before_its_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    first = computed(bm, Sequence(1, "a", [1, 2, 3, 4, 5]))
    head = first.block_table[0]
    bm.free(first)
    bm.allocate(Sequence(2, "b", range(5)), 5)  # three blocks: two free ones, then one eviction
    assert bm.find_cached_prefix(Sequence(3, "c", [1, 2, 3, 4, 5])) == [head]


@pytest.mark.parametrize("touch_first_again", [False, True])
def test_eviction_takes_the_least_recently_used_block(touch_first_again: bool) -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    x = computed(bm, Sequence(1, "x", [1, 2, 3]))
    y = computed(bm, Sequence(2, "y", [5, 6, 7]))
    bm.free(x)
    bm.free(y)
    if touch_first_again:
        bm.free(admitted(bm, Sequence(3, "x2", [1, 2, 3])))
    bm.allocate(Sequence(4, "z", [9] * 6), 6)  # three blocks: two free ones, then one eviction
    x_left = bm.find_cached_prefix(Sequence(5, "x3", [1, 2, 3])) != []
    y_left = bm.find_cached_prefix(Sequence(6, "y3", [5, 6, 7])) != []
    assert (x_left, y_left) == (touch_first_again, not touch_first_again)


def test_invalidate_prefix_cache_drops_every_cached_block_once() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    bm.free(computed(bm, Sequence(1, "a", range(9))))
    running = computed(bm, Sequence(2, "b", range(100, 106)))  # one cached block, still referenced
    before = bm.num_free_blocks
    assert bm.invalidate_prefix_cache() == 3
    assert bm.invalidate_prefix_cache() == 0
    assert bm.stats().num_cached_blocks == 0 and bm.num_free_blocks == before
    assert bm.find_cached_prefix(Sequence(3, "c", range(9))) == []
    # KV computed before the invalidation is never cached, even when its block fills up afterwards.
    running.append_token(106)
    running.append_token(107)
    computed(bm, running)
    assert bm.stats().num_cached_blocks == 0
    # KV computed afterwards is cached as usual.
    computed(bm, Sequence(4, "d", range(9)))
    assert len(bm.find_cached_prefix(Sequence(5, "e", range(9)))) == 2


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    computed(bm, Sequence(1, "a", range(9)))
    again = admitted(bm, Sequence(2, "b", range(9)))
    assert again.num_cached_tokens == 0
    assert bm.stats().num_cached_blocks == 0 and bm.stats().prefix_cache_queries == 0


def test_fork_shares_blocks_and_copies_the_partial_block_on_write() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = computed(bm, Sequence(1, "r", range(6)))  # a full block and a partial one
    child = parent.fork(2)
    bm.fork(parent, child)
    full, partial = parent.block_table
    assert child.block_table == [full, partial]
    assert bm.ref_count(full) == bm.ref_count(partial) == 2
    assert bm.num_used_blocks == 2

    child.append_token(40)
    copies = bm.append_slot(child)
    assert len(copies) == 1 and copies[0][0] == partial
    assert child.block_table == [full, copies[0][1]]
    assert (bm.ref_count(full), bm.ref_count(partial), bm.ref_count(copies[0][1])) == (2, 1, 1)

    parent.append_token(41)
    assert bm.append_slot(parent) == []  # the last owner writes in place
    assert parent.block_table == [full, partial]


def test_fork_with_a_full_last_block_needs_no_copy() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = computed(bm, Sequence(1, "r", range(8)))
    child = parent.fork(2)
    bm.fork(parent, child)
    child.append_token(40)
    assert bm.append_slot(child) == []
    assert child.block_table[:2] == parent.block_table and len(child.block_table) == 3


def test_copy_on_write_counts_in_can_allocate() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    parent = computed(bm, Sequence(1, "r", range(6)))
    child = parent.fork(2)
    bm.fork(parent, child)
    child.append_token(40)
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate(child, 1)
    bm.free(parent)
    assert bm.can_allocate(child, 1) and bm.append_slot(child) == []


def test_shared_blocks_outlive_all_but_their_last_owner() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = computed(bm, Sequence(1, "r", range(6)))
    child = parent.fork(2)
    bm.fork(parent, child)
    bm.free(parent)
    assert [bm.ref_count(b) for b in child.block_table] == [1, 1]
    assert bm.num_used_blocks == 2
    bm.free(child)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8
