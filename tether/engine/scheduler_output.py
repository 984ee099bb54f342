"""The engine core's step contract: what `Scheduler.schedule()` plans for one step (the chunks to compute,
preemptions, copy-on-write block copies, swaps to and from the host tier) and the preemption choice it
asks of the KV tiers. Plain data: the model runner executes it, the tiers copy the swaps, and the
scheduler applies the results (`Scheduler.update_from_output`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tether.engine.block_manager import BlockCopy, slot_mapping
from tether.engine.config import PreemptionMode


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    seq_id: int
    start: int
    """First position computed this step."""
    num_tokens: int
    block_table: list[int]
    samples: bool
    """This chunk reaches the last known token: the model must return logits for its last position (for
    every position from the last known token on when it carries drafts)."""
    token_ids: list[int]
    """Input tokens of positions [start, start + num_tokens), drafts included."""
    draft_token_ids: tuple[int, ...] = ()
    """Speculative tokens after the last known token: the last `len(draft_token_ids)` of `token_ids`."""

    @property
    def end(self) -> int:
        """Tokens with KV once this step ran: the attention context length."""
        return self.start + self.num_tokens

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.num_tokens)

    def slot_mapping(self, block_size: int) -> list[int]:
        """The flat KV slot each computed position writes to."""
        return slot_mapping(self.block_table, block_size, self.start, self.num_tokens)


@dataclass(frozen=True, slots=True)
class SwapOut:
    """Copy the KV of a preempted sequence's first `num_tokens` positions, held in `block_ids` (freed
    this step: read them before any write), to the host tier."""

    seq_id: int
    block_ids: list[int]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class SwapIn:
    """Copy a swapped-out sequence's KV back from the host tier into `block_ids`, before the forward."""

    seq_id: int
    block_ids: list[int]


class PreemptionChooser(Protocol):
    def __call__(self, seq_id: int, num_blocks: int, num_tokens: int) -> PreemptionMode:
        """SWAP (then host room for `num_blocks` is promised to the sequence) or RECOMPUTE for a sequence
        holding `num_blocks` blocks of KV for `num_tokens` computed tokens."""
        ...


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[int]
    """Sequences preempted this step (swapped out or to be computed again)."""
    copies: list[BlockCopy]
    """Block copies (copy-on-write) to perform before the forward pass."""
    swap_out: list[SwapOut] = field(default_factory=list)
    swap_in: list[SwapIn] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
