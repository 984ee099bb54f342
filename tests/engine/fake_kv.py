"""A stand-in for the KV cache in scheduler tests: a dict from flat slot to what was written there."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

Value = TypeVar("Value")


def apply_block_copies(kv: dict[int, Value], copies: Iterable[tuple[int, int]], block_size: int) -> None:
    """Perform a step's copy-on-write block copies (src, dst), all read before any is written."""
    snapshot = dict(kv)
    for source, destination in copies:
        for offset in range(block_size):
            if source * block_size + offset in snapshot:
                kv[destination * block_size + offset] = snapshot[source * block_size + offset]
