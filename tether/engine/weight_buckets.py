"""The bucket layout of one weight update: which tensor lies where in which flat buffer, in what dtype.

Pure: no process group, no copy. The plan is the metadata message of the weight-sync protocol
(`weight_sync.py`): the sender packs tensors into buckets by it, each engine cuts its received buckets
back into named tensors by it, and its JSON-ready message form is what travels between them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tether.engine.model_runner import WeightUpdateError


@dataclass(frozen=True, slots=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    offset: int
    """Elements before this tensor in its bucket."""

    @property
    def numel(self) -> int:
        return _numel(self.shape)


@dataclass(frozen=True, slots=True)
class UpdatePlan:
    """What one update carries and how it is cut into buckets; the metadata message of the protocol."""

    version: int
    dtype: torch.dtype
    buckets: tuple[tuple[TensorSlot, ...], ...]

    @property
    def slots(self) -> list[TensorSlot]:
        return [slot for bucket in self.buckets for slot in bucket]

    @property
    def bucket_numels(self) -> list[int]:
        return [bucket[-1].offset + bucket[-1].numel for bucket in self.buckets]

    @property
    def nbytes(self) -> int:
        return sum(self.bucket_numels) * torch.empty((), dtype=self.dtype).element_size()

    def to_message(self) -> dict[str, Any]:
        buckets = [[[slot.name, list(slot.shape), slot.offset] for slot in bucket] for bucket in self.buckets]
        return {"version": self.version, "dtype": dtype_name(self.dtype), "buckets": buckets}

    @classmethod
    def from_message(cls, raw: dict[str, Any]) -> UpdatePlan:
        buckets = tuple(
            tuple(TensorSlot(name, tuple(shape), offset) for name, shape, offset in bucket)
            for bucket in raw["buckets"]
        )
        return cls(raw["version"], parse_dtype(raw["dtype"]), buckets)


def plan_update(
    shapes: Iterable[tuple[str, tuple[int, ...]]], version: int, dtype: torch.dtype, bucket_bytes: int
) -> UpdatePlan:
    """Tensors in the given order, packed into buckets of at most `bucket_bytes` (one larger tensor fills
    a bucket of its own); empty tensors take no room but keep their slot."""
    size = torch.empty((), dtype=dtype).element_size()
    buckets: list[tuple[TensorSlot, ...]] = []
    current: list[TensorSlot] = []
    used = 0
    for name, shape in shapes:
        numel = _numel(shape)
        if current and (used + numel) * size > bucket_bytes:
            buckets.append(tuple(current))
            current, used = [], 0
        current.append(TensorSlot(name, tuple(shape), used))
        used += numel
    if current:
        buckets.append(tuple(current))
    return UpdatePlan(version, dtype, tuple(buckets))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise WeightUpdateError(f"weight sync: dtype {name!r} is not a floating-point torch dtype")
    return dtype


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
