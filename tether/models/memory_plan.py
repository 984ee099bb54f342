"""How much memory one rank of a training job needs, from the model's shape alone (`tether train --plan`).

Nothing is allocated: the model is built on the meta device, so a 72B-parameter plan runs on a laptop.
Parameter counts are measured from that model (tied embeddings counted once, Qwen2 biases included).
The rest follows from how tether trains:

- `parameters`, `gradients`, `optimizer`: the float32 weights AdamW updates, their float32 gradients and
  its two float32 moments (4 + 4 + 8 bytes a parameter); FSDP shards all three over the ranks (1/N each).
- `working_weights`: copies in the compute dtype held while a micro-batch runs. Single process: none in
  float32 (the weights are used as they are), a whole bfloat16/float16 copy otherwise (autocast's casts,
  kept for backward). FSDP2 (`fully_shard` per decoder layer, mixed precision with float32 reductions):
  the root's parameters (embedding, final norm, head), which stay gathered through forward and backward,
  and two decoder layers (the one computing and the one prefetched).
- `activations`: measured, not a formula: the bytes of the tensors autograd saves for backward when the
  training forward (`dense.token_logprobs`) runs one micro-batch on meta tensors, with 1 and with 2
  layers (the difference is one layer's share). With activation checkpointing a layer keeps only its
  input, and one layer's activations are live again during its recomputation. Temporaries inside a
  single op and the backward's own buffers are not counted; nothing is sharded (data parallel). On the
  meta device attention takes torch's math kernel, which saves its scores and the keys expanded to
  every query head: CUDA's flash and memory-efficient kernels save less, so there the row is an upper
  bound.
- `engine_weights`, `kv_cache`: the rollout engine's own copy in the compute dtype and its paged KV cache
  (2 x layers x KV heads x head dim per token), on the rank when it shares the learner's device.

Limits: no tensor or pipeline parallelism, no LoRA (a LoRA run's gradients and optimizer are far smaller),
no allocator fragmentation or CUDA context (add a few GiB of headroom on a GPU).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

import torch

from tether.errors import ConfigError
from tether.models.config import ModelConfig
from tether.models.dense import DenseBatch, token_logprobs
from tether.models.precision import DType
from tether.models.transformer import CausalLM

FLOAT32_BYTES = 4
ADAM_MOMENTS = 2


class Strategy(StrEnum):
    SINGLE = "single"  # one process holds every weight, gradient and optimizer state
    FSDP = "fsdp"  # FSDP2: parameters, gradients and optimizer state sharded over the ranks


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """The largest micro-batch the learner forms: `prompts` prompts packed in one row, each shared by
    `samples` completions of `completion_tokens` (every completion at the longest it may be)."""

    prompts: int
    samples: int
    prompt_tokens: int
    completion_tokens: int

    def __post_init__(self) -> None:
        for name in ("prompts", "samples", "prompt_tokens", "completion_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"micro-batch {name} = {getattr(self, name)}: expected at least 1")

    @classmethod
    def of(
        cls,
        sequences: int,
        samples_per_prompt: int,
        prompt_tokens: int,
        completion_tokens: int,
        max_tokens: int | None = None,
    ) -> MicroBatch:
        """As `rl.samples.plan_micro_batches` forms them: a group over `sequences` samples (or `max_tokens`
        tokens) is split, smaller groups share a micro-batch up to both bounds."""
        samples = min(samples_per_prompt, sequences)
        prompts = max(1, sequences // samples)
        if max_tokens is not None:
            samples = max(1, min(samples, (max_tokens - prompt_tokens) // completion_tokens))
            prompts = max(1, min(prompts, max_tokens // (prompt_tokens + samples * completion_tokens)))
        return cls(prompts, samples, prompt_tokens, completion_tokens)

    @property
    def tokens(self) -> int:
        return self.prompts * (self.prompt_tokens + self.samples * self.completion_tokens)

    def dense_batch(self) -> DenseBatch:
        group = ([1] * self.prompt_tokens, [[1] * self.completion_tokens] * self.samples)
        return DenseBatch.shared_prefix([group] * self.prompts)

    def targets(self) -> list[tuple[int, int]]:
        total = self.prompt_tokens + self.completion_tokens
        return [(self.prompt_tokens, total)] * (self.prompts * self.samples)


@dataclass(frozen=True, slots=True)
class PlanSettings:
    strategy: Strategy
    world_size: int
    dtype: DType  # compute dtype of the learner and the engine
    micro_batch: MicroBatch
    activation_checkpointing: bool = False
    kv_cache_tokens: int = 0  # tokens the engine's KV cache holds (0: no engine on this rank)
    engine: bool = True  # the rollout engine shares this rank's device

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size = {self.world_size}: expected at least 1")
        if self.strategy is Strategy.SINGLE and self.world_size != 1:
            raise ConfigError(
                f"strategy = 'single' runs one process, world_size = {self.world_size}: "
                "use strategy = 'fsdp' to shard over several ranks"
            )
        if self.kv_cache_tokens < 0:
            raise ConfigError(f"kv_cache_tokens = {self.kv_cache_tokens}: expected 0 or more")


CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer",
    "working_weights",
    "activations",
    "engine_weights",
    "kv_cache",
)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes one rank holds at the peak of a training step, per category (`CATEGORIES`)."""

    model: str
    parameter_count: int
    settings: PlanSettings
    bytes: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def to_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "parameter_count": self.parameter_count,
            "strategy": self.settings.strategy.value,
            "world_size": self.settings.world_size,
            "dtype": self.settings.dtype.value,
            "micro_batch_tokens": self.settings.micro_batch.tokens,
            "activation_checkpointing": self.settings.activation_checkpointing,
            "kv_cache_tokens": self.settings.kv_cache_tokens if self.settings.engine else 0,
            "bytes": dict(self.bytes),
            "total_bytes": self.total,
        }


def meta_model(config: ModelConfig, dtype: torch.dtype = torch.float32) -> CausalLM:
    """`CausalLM(config)` on the meta device: shapes without memory."""
    with torch.device("meta"):
        return CausalLM(config).to(dtype)


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding and head count once)."""
    return sum(p.numel() for p in model.parameters())


def _saved_bytes(config: ModelConfig, layers: int, dtype: torch.dtype, micro_batch: MicroBatch) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves over one micro-batch's forward."""
    windows = tuple(config.layer_windows[i % config.num_layers] for i in range(layers))
    model = meta_model(dataclasses.replace(config, num_layers=layers, layer_windows=windows), dtype)
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in weights:  # views of one storage count once, at its full size
            saved[storage._cdata] = storage.nbytes()
        return tensor

    batch = micro_batch.dense_batch().to("meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        token_logprobs(model, batch, micro_batch.targets())
    return sum(saved.values())


def activation_bytes(config: ModelConfig, settings: PlanSettings) -> int:
    dtype = settings.dtype.torch
    one = _saved_bytes(config, 1, dtype, settings.micro_batch)
    per_layer = _saved_bytes(config, 2, dtype, settings.micro_batch) - one
    outside = one - per_layer  # embedding, final norm, head and logprobs
    if not settings.activation_checkpointing:
        return outside + config.num_layers * per_layer
    rows, width = settings.micro_batch.dense_batch().input_ids.shape
    layer_input = rows * width * config.hidden_size * dtype.itemsize
    return outside + config.num_layers * layer_input + per_layer


def kv_bytes_per_token(config: ModelConfig, dtype: DType) -> int:
    return config.kv_bytes_per_token(dtype.torch.itemsize)


def plan_memory(name: str, config: ModelConfig, settings: PlanSettings) -> MemoryPlan:
    """The per-rank memory of training `config` with `settings` (see the module docstring)."""
    model = meta_model(config)
    count = parameter_count(model)
    layer = parameter_count(model.model.layers[0])
    shard = count / settings.world_size  # FSDP pads each shard to equal size: < 1 row a tensor
    compute = settings.dtype.torch.itemsize
    if settings.strategy is Strategy.FSDP:
        root = count - config.num_layers * layer
        working = (root + min(2, config.num_layers) * layer) * compute
    else:
        working = 0 if settings.dtype is DType.FLOAT32 else count * compute
    engine = settings.engine
    sizes = {
        "parameters": shard * FLOAT32_BYTES,
        "gradients": shard * FLOAT32_BYTES,
        "optimizer": shard * FLOAT32_BYTES * ADAM_MOMENTS,
        "working_weights": working,
        "activations": activation_bytes(config, settings),
        "engine_weights": count * compute if engine else 0,
        "kv_cache": settings.kv_cache_tokens * kv_bytes_per_token(config, settings.dtype) if engine else 0,
    }
    assert tuple(sizes) == CATEGORIES
    return MemoryPlan(name, count, settings, {key: int(value) for key, value in sizes.items()})
