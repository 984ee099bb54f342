"""Hot weight updates: the policy for in-flight requests, checking named tensors, and the queue of updates
that wait for the requests admitted before them.

Bookkeeping only: `LLMEngine.update_weights` copies tensors into the model and moves sequences; this
module says whether an update is acceptable and when it may be applied. Every policy keeps one invariant:
a token is sampled with exactly the weights of the version it is tagged with, and the prefix cache is
invalidated once per applied version (KV is never reused across versions). Because of that, `pause_resume`
recomputes the running batch's KV after each update: updates must come less often than that takes (one
step when the batch fits `max_num_batched_tokens`) for requests to make progress.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import nn

from tether.engine.model_runner import WeightUpdateError
from tether.errors import ConfigError
from tether.models.quantize import QuantizedLinear

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class UpdatePolicy(Enum):
    """What a weight update does to requests already admitted when it arrives."""

    WAIT = "wait"
    """The update is applied once every request admitted before it has finished; requests added meanwhile
    are held back and admitted after it. No completion ever spans two versions."""
    PAUSE_RESUME = "pause_resume"
    """Applied at once. In-flight sequences keep their tokens, behaviour logprobs and version tags; their KV
    (computed by the old weights) is dropped and recomputed under the new ones before they sample again, so
    a completion may span versions and says so (`Completion.policy_versions`)."""
    ABORT_AND_RETRY = "abort_and_retry"
    """Applied at once. Requests that had generated tokens start again from their prompt under the new
    weights (with the same seeds) and count the restart in `RequestOutput.retries`, up to `max_retries`
    times; after that a request carries on through updates as under `pause_resume`, so that updates more
    frequent than a request's length cannot starve it."""


@dataclass(frozen=True, slots=True)
class WeightUpdateConfig:
    policy: UpdatePolicy | str = UpdatePolicy.WAIT
    """Accepts the enum or its value; stored as the enum. `wait` by default: nothing is ever mixed."""
    max_retries: int = 3
    """Restarts of one request under `abort_and_retry` before it continues across versions instead."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_retries, bool)
            or not isinstance(self.max_retries, int)
            or self.max_retries < 0
        ):
            raise ConfigError(
                f"engine: weight update max_retries = {self.max_retries!r}: expected an integer of at least 0"
            )
        try:
            policy = UpdatePolicy(self.policy)
        except ValueError:
            accepted = ", ".join(repr(p.value) for p in UpdatePolicy)
            raise ConfigError(
                f"engine: weight update policy = {self.policy!r}: expected one of {accepted}"
            ) from None
        object.__setattr__(self, "policy", policy)

    @property
    def update_policy(self) -> UpdatePolicy:
        assert isinstance(self.policy, UpdatePolicy)
        return self.policy


@dataclass(frozen=True, slots=True)
class WeightUpdateStats:
    policy_version: int
    """Version of the weights in the model now."""
    num_updates_applied: int
    num_prefix_cache_invalidations: int
    """Exactly one per applied update."""
    num_pending_updates: int
    """Accepted updates still waiting for earlier requests (`wait` policy)."""
    num_held_requests: int
    """Requests added after a pending update and admitted once it is applied."""
    num_retried_requests: int
    """Restarts from the prompt (`abort_and_retry`), summed over requests."""
    num_recomputed_sequences: int
    """Sequences whose KV was dropped to be recomputed under new weights (`pause_resume`, and partial
    prefills under `abort_and_retry`)."""


def parameter_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The names and shapes a weight update may carry: those of the float model, int8 layers included."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            shapes[f"{name}.weight"] = (module.out_features, module.in_features)
    return shapes


def check_named_tensors(
    shapes: Mapping[str, tuple[int, ...]], named_tensors: NamedTensors
) -> list[tuple[str, torch.Tensor]]:
    """The update as a list, once every name, shape and dtype is acceptable; nothing is applied here, so a
    bad update is rejected whole."""
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    if not items:
        raise WeightUpdateError("a weight update needs at least one named tensor; got none")
    seen: set[str] = set()
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            kind = type(tensor).__name__
            raise WeightUpdateError(f"parameter {name!r}: expected a torch.Tensor, got {kind}")
        if name in seen:
            raise WeightUpdateError(f"parameter {name!r} appears twice in one weight update")
        seen.add(name)
        if name not in shapes:
            close = [p for p in shapes if p.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]][:3]
            like = close or list(shapes)[:3]
            raise WeightUpdateError(f"unknown parameter {name!r}; names look like {like}")
        if tuple(tensor.shape) != shapes[name]:
            raise WeightUpdateError(f"parameter {name!r} has shape {shapes[name]}, got {tuple(tensor.shape)}")
        if not tensor.is_floating_point():
            dtype = tensor.dtype
            raise WeightUpdateError(f"parameter {name!r}: expected a floating-point tensor, got {dtype}")
    return items


def check_version(version: int, latest: int) -> None:
    """Versions only move forward: a new one must exceed every version applied or pending."""
    if isinstance(version, bool) or not isinstance(version, int) or version <= latest:
        raise WeightUpdateError(
            f"weight update version {version!r}: expected an integer greater than {latest} "
            "(the latest version applied or pending)"
        )


@dataclass(slots=True)
class PendingUpdate:
    version: int
    tensors: list[tuple[str, torch.Tensor]]
    """Private copies: the caller may keep training its own tensors while the update waits."""
    barrier: set[str]
    """Requests admitted before the update; it is applied once none is left."""
    held: list[str] = field(default_factory=list)
    """Requests added after it (and before the next update), in arrival order: admitted once it is applied."""


class UpdateQueue:
    """Updates accepted under `wait` and not applied yet, oldest first, with the requests each holds back."""

    def __init__(self) -> None:
        self._pending: deque[PendingUpdate] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def latest_version(self) -> int | None:
        return self._pending[-1].version if self._pending else None

    @property
    def num_held(self) -> int:
        return sum(len(update.held) for update in self._pending)

    def push(self, version: int, tensors: list[tuple[str, torch.Tensor]], in_flight: Iterable[str]) -> None:
        copies = [(name, tensor.detach().clone()) for name, tensor in tensors]
        self._pending.append(PendingUpdate(version, copies, set(in_flight)))

    def hold(self, request_id: str) -> bool:
        """Whether a newly added request must wait behind a pending update (then it is recorded)."""
        if not self._pending:
            return False
        self._pending[-1].held.append(request_id)
        return True

    def forget(self, request_id: str) -> None:
        """A request finished or was aborted: no update waits for it any more."""
        for update in self._pending:
            update.barrier.discard(request_id)
            if request_id in update.held:
                update.held.remove(request_id)

    def pop_ready(self) -> PendingUpdate | None:
        """The oldest update, once every request it waits for has finished."""
        if self._pending and not self._pending[0].barrier:
            return self._pending.popleft()
        return None
