"""The paged KV cache: per layer, K and V tensors of shape [num_blocks, block_size, num_kv_heads, head_dim].

A token's K/V live at flat slot `block_id * block_size + offset`. This module only allocates and views
the storage; which blocks a sequence owns is the block manager's business, and attention reads them
through `tether.kernels.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class CacheShape(Protocol):
    """What the cache's size depends on (a `models.config.ModelConfig` has it)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


@dataclass(slots=True)
class KVCache:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    block_size: int

    @classmethod
    def allocate(
        cls,
        config: CacheShape,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> KVCache:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        return cls(keys=keys, values=values, block_size=block_size)

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (src, dst) in every layer: the block manager's copy-on-write."""
        sources = torch.tensor([src for src, _ in copies], dtype=torch.long, device=self.keys[0].device)
        targets = torch.tensor([dst for _, dst in copies], dtype=torch.long, device=self.keys[0].device)
        for layer in range(self.num_layers):
            self.keys[layer][targets] = self.keys[layer][sources]
            self.values[layer][targets] = self.values[layer][sources]

    def gather_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Per layer, K then V of the blocks, each [len(block_ids), block_size, heads, head_dim]: one
        index_select per tensor whatever the number of blocks."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.keys[0].device)
        return [t.index_select(0, index) for t in (*self.keys, *self.values)]

    def scatter_blocks(self, block_ids: list[int], blocks: list[torch.Tensor]) -> None:
        """Write `blocks` (as `gather_blocks` returns them, on any device) into the blocks: one
        index_copy_ per tensor."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.keys[0].device)
        for target, source in zip((*self.keys, *self.values), blocks, strict=True):
            target.index_copy_(0, index, source.to(target.device, non_blocking=True))
