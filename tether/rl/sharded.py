"""The sharded learner: FSDP2 data parallelism over the learner ranks, offering the `Learner` interface.

Every rank holds a shard of each parameter, its gradient and its AdamW moments (`fully_shard` per decoder
layer, then the root: embeddings, final norm, head). Rank 0 runs the trainer and tells the other ranks what
to do (step, gather weights, save, load, stop); they wait in `follow()`. A step trains every rank on its
share of the batch's prompt groups (a deterministic split), with losses divided by the whole batch's
counts and gradients summed (not averaged) across ranks, so the update equals the single-process one up
to float summation order; the statistics are reduced so every strategy reports the same `learner/*`.
With `context_parallel` = C > 1, groups of C consecutive ranks compute the same micro-batches, each
holding a share of every micro-batch's token row (`context_parallel.py`: attention by ring exchange); the
data split is over the world_size / C groups. FSDP still shards and sums over every rank: a rank's
gradient is its tokens' part of its group's, so the sum over all ranks is the whole batch's. The loss and
its statistics are computed alike by every rank of a group, and counted once.

The dense training forward calls a layer's norms, projections and MLP one by one, never the layer
itself, so each layer's FSDP unit is the group of its modules that own parameters (`fully_shard` of a
list: gathered when the first one runs) and the root unit is a module whose forward runs the whole
training forward. This module knows nothing of rollouts or run directories.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from tether.errors import ConfigError
from tether.models.dense import DenseBatch
from tether.models.transformer import CausalLM, DecoderLayer
from tether.rl.cluster_sections import LearnerSection
from tether.rl.context_parallel import RingGroup, token_logprobs
from tether.rl.distributed import LearnerGroup
from tether.rl.learner import Learner, LearnStats, Ratios, check_compute_dtype
from tether.rl.losses import Normaliser
from tether.rl.samples import Row, Sample, prompt_groups, row_tokens


class Command(StrEnum):
    """What rank 0 tells the other ranks to do next (each is a collective they all take part in)."""

    STEP = "step"
    WEIGHTS = "weights"
    SAVE = "save"
    LOAD = "load"
    STOP = "stop"


class _Forward(torch.nn.Module):
    """The root FSDP unit: its forward runs the training forward handed to it, so FSDP's root hooks
    (gather the root's weights, then reduce its gradients in backward) frame every micro-batch."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, run: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        # The per-sample logprobs are views of one tensor; FSDP hooks its backward on each output and
        # warns that an in-place op on a view would skip it. Copies (a few thousand floats) cannot.
        return [logprobs.clone() for logprobs in run()]


def _owners(module: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in module.modules() if next(m.parameters(recurse=False), None) is not None]


def _recompute_in_backward(module: torch.nn.Module) -> None:
    """Activation checkpointing without renaming parameters (a checkpoint wrapper would prefix them)."""
    forward = module.forward

    def checkpointed(*args: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False)

    module.forward = checkpointed


def shard_model(
    model: CausalLM, group: LearnerGroup, options: LearnerSection, param_dtype: torch.dtype
) -> _Forward:
    """FSDP2 over `group`'s "dp" mesh: one unit per decoder layer, explicit prefetch, then the root."""
    mesh = group.mesh
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    units: list[FSDPModule] = []
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        if options.activation_checkpointing:
            _recompute_in_backward(layer.mlp)  # the MLP holds most of a layer's activations
        members = fully_shard(
            _owners(layer), mesh=mesh, mp_policy=policy, reshard_after_forward=options.reshard_after_forward
        )
        units.append(members[0])  # every member shares the unit's state
    root = _Forward(model)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    assert isinstance(root, FSDPModule)  # fully_shard swaps the module's class in place
    units.append(root)
    for unit in units:
        # Sum the ranks' gradients (each is already divided by the whole batch's counts); gloo has
        # neither AVG nor PREMUL_SUM, so the sum is a plain SUM with no scaling.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    layers = units[:-1]
    if options.prefetch > 0:
        for index, unit in enumerate(layers):
            unit.set_modules_to_forward_prefetch(layers[index + 1 : index + 1 + options.prefetch])
            unit.set_modules_to_backward_prefetch(layers[max(index - options.prefetch, 0) : index][::-1])
    return root


def split_groups(samples: Sequence[Sample], trained: Sequence[bool], ranks: int) -> list[list[bool]]:
    """Which trained samples each rank computes: whole prompt groups (the prompt stays shared within a
    row), largest first onto the rank with the fewest tokens so far (lowest rank on ties)."""

    def tokens(members: list[int]) -> int:
        return row_tokens(samples, members)

    load = [0] * ranks
    shares = [[False] * len(samples) for _ in range(ranks)]
    for members in sorted(prompt_groups(samples, trained), key=tokens, reverse=True):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        load[rank] += tokens(members)
        for index in members:
            shares[rank][index] = True
    return shares


class ShardedLearner(Learner):
    """A `Learner` whose model and optimizer are sharded over `group`; rank 0's methods lead the others."""

    def __init__(
        self,
        model: CausalLM,
        group: LearnerGroup,
        options: LearnerSection,
        compute_dtype: torch.dtype = torch.float32,
        **learner: Any,
    ) -> None:
        """`compute_dtype`: FSDP gathers the float32 master weights in it for forward and backward
        (half the all-gather traffic), and the forward runs under the single learner's autocast, so both
        strategies compute alike; gradients reduce in float32."""
        if learner.get("lora") is not None:
            raise ConfigError("learner.strategy = 'fsdp' with [model.lora]: use learner.strategy = 'single'")
        if compute_dtype is torch.float16:
            # Loss scaling skips a step whose gradients overflowed: every rank would have to agree.
            raise ConfigError(
                "model.dtype = 'float16' with learner.strategy = 'fsdp': the sharded learner does not "
                "scale the loss; use bfloat16 (float32's range, no scaling) or learner.strategy = 'single'"
            )
        check_compute_dtype(compute_dtype, group.device)
        self.group = group
        # Every rank creates every ring's process group, before FSDP's first collective.
        self.ring = (
            RingGroup.open(options.context_parallel, options.timeout_s)
            if options.context_parallel > 1
            else None
        )
        context = self.ring.size if self.ring is not None else 1
        self.data_ranks, self.data_rank = group.world_size // context, group.rank // context
        self.root = shard_model(model.train().requires_grad_(True), group, options, compute_dtype)
        super().__init__(
            model, compute_dtype=compute_dtype, **learner
        )  # the optimizer over the sharded (DTensor) parameters
        self.device = group.device
        self.checkpoint_group = group.checkpoint_group

    # --- what rank 0 calls; every rank runs the same collectives -----------------------------------

    def _lead(self, command: Command, payload: Any = None) -> None:
        assert self.group.is_coordinator, "only rank 0 leads; the other ranks follow()"
        dist.broadcast_object_list([command.value, payload], src=0)

    def step(self, samples: Sequence[Sample]) -> LearnStats:
        if self.group.is_coordinator:
            self._lead(Command.STEP, list(samples))
        return super().step(samples)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full tensors (gathered from the shards) on rank 0: what the rollout engine loads."""
        self._lead(Command.WEIGHTS)
        return iter(self._gather())

    def save_state(self, directory: Path) -> Future[Any] | None:
        self._lead(Command.SAVE, str(directory))
        return super().save_state(directory)

    def load_state(self, directory: Path) -> None:
        self._lead(Command.LOAD, str(directory))
        super().load_state(directory)

    def close(self) -> None:
        """Rank 0: release the other ranks from `follow()`; every rank: finish its checkpoint writes,
        then leave the process group."""
        if self.group.is_coordinator and dist.is_initialized():
            self._lead(Command.STOP)
        try:
            self.wait_saved()
        finally:
            self.group.close()

    def follow(self) -> None:
        """Ranks > 0: do what rank 0 says until it says stop."""
        assert not self.group.is_coordinator, "rank 0 leads"
        while True:
            message: list[Any] = [None, None]
            dist.broadcast_object_list(message, src=0)
            command, payload = Command(message[0]), message[1]
            if command is Command.STOP:
                self.wait_saved()
                return
            if command is Command.STEP:
                super().step(payload)
            elif command is Command.WEIGHTS:
                self._gather()
            elif command is Command.SAVE:
                super().save_state(Path(payload))
            else:
                assert command is Command.LOAD
                super().load_state(Path(payload))

    def _gather(self) -> list[tuple[str, torch.Tensor]]:
        gathered = []
        for name, param in self.model.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            if self.group.is_coordinator:  # the other ranks drop each tensor once it is gathered
                gathered.append((name, full.detach()))
        return gathered

    # --- the data-parallel parts of Learner.step ---------------------------------------------------

    def _logprobs(self, model: CausalLM, rows: Sequence[Sequence[Sample]]) -> list[torch.Tensor]:
        if model is not self.model:  # the frozen reference: a plain forward on every rank
            return super()._logprobs(model, rows)
        outputs: list[torch.Tensor] = self.root(functools.partial(Learner._logprobs, self, model, rows))
        return outputs

    def _token_logprobs(
        self, model: CausalLM, batch: DenseBatch, targets: Sequence[tuple[int, int]]
    ) -> list[torch.Tensor]:
        if self.ring is None:
            return super()._token_logprobs(model, batch, targets)
        return token_logprobs(model, batch, targets, self.temperature, self.ring)

    def _micro_batches(self, samples: Sequence[Sample], trained: Sequence[bool]) -> list[list[Row]]:
        """This rank's micro-batches, padded with empty ones to the most any rank has: every rank must
        run as many forwards and backwards, since each gathers and reduces with the others."""
        mine = split_groups(samples, trained, self.data_ranks)[self.data_rank]
        batches = super()._micro_batches(samples, mine)
        count = torch.tensor([len(batches)], dtype=torch.long)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return batches + [[] for _ in range(int(count) - len(batches))]

    def _accumulate(
        self,
        samples: Sequence[Sample],
        masks: Sequence[Sequence[bool]],
        rows: Sequence[Row],
        norm: Normaliser,
        totals: dict[str, float],
        ratios: Ratios,
    ) -> None:
        if rows:
            super()._accumulate(samples, masks, rows, norm, totals, ratios)
            return
        # Nothing left for this rank: a forward and backward whose gradient is exactly 0 keeps its
        # collectives in step with the ranks still computing.
        logprobs = self._logprobs(self.model, [[samples[0]]])
        torch.autograd.backward(torch.cat(logprobs).sum() * 0.0)

    def _reduce(self, totals: dict[str, float], ratios: Ratios) -> None:
        names = ("loss", "policy_loss", "kl", "clip")
        sums = torch.tensor(
            [
                *(totals[n] for n in names),
                ratios.count,
                ratios.total,
                ratios.squares,
                ratios.weighted,
                ratios.truncated,
                ratios.weights,
            ],
            dtype=torch.float64,
        )
        highs = torch.tensor([ratios.high, ratios.gap, -ratios.low], dtype=torch.float64)
        if self.ring is not None and self.ring.rank > 0:
            sums.zero_()  # its group's first rank counts the statistics every rank of it computed alike
        dist.all_reduce(sums)
        dist.all_reduce(highs, op=dist.ReduceOp.MAX)
        for name, value in zip(names, sums[:4].tolist(), strict=True):
            totals[name] = value
        count, total, squares, weighted, truncated, weights = sums[4:].tolist()
        ratios.count, ratios.total, ratios.squares = int(count), total, squares
        ratios.weighted, ratios.truncated, ratios.weights = int(weighted), int(truncated), weights
        ratios.high, ratios.gap, ratios.low = highs[0].item(), highs[1].item(), -highs[2].item()


def local_state_bytes(learner: Learner) -> int:
    """Bytes of parameters and optimizer state this rank holds (its shards only, for a sharded one)."""

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    params = {id(p): local(p) for p in learner.trainable.parameters()}  # tied weights count once
    states = [
        local(value)
        for state in learner.optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    return sum(t.numel() * t.element_size() for t in [*params.values(), *states])
