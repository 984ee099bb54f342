"""The prefix-cache key of a block of tokens: blake2b-128 over the parent block's key and this block's token
ids (little-endian int64), chained from the first block. The engine's prefix cache (`engine/block_manager.py`)
keys its blocks by it and the gateway's prefix-aware routing (`gateway/prefix_key.py`) hashes requests with
it, so both name a prompt's leading blocks alike, in any process. It knows nothing about models or text.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The prefix-cache key of a full block: its tokens chained to the hash of the block before it."""
    digest = hashlib.blake2b(digest_size=16)
    if parent is not None:
        digest.update(parent)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def hash_prefix(token_ids: Sequence[int], block_size: int, num_blocks: int) -> BlockHash | None:
    """The key of the first `num_blocks` full blocks of `token_ids` (the chain's last link), or None for
    no block. Asks for no more blocks than the tokens fill."""
    assert block_size >= 1 and 0 <= num_blocks <= len(token_ids) // block_size
    key: BlockHash | None = None
    for i in range(num_blocks):
        key = hash_block(key, token_ids[i * block_size : (i + 1) * block_size])
    return key
