"""The engine's limits, one frozen dataclass checked on construction.

Sizes are counted in tokens, KV blocks or sequences, as each field's name says. Only plain values live
here: the model, the device and the dtype belong to the model runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tether.errors import ConfigError


class PreemptionMode(Enum):
    """What happens to a preempted sequence's KV."""

    RECOMPUTE = "recompute"
    """Drop it and prefill the sequence again later."""
    SWAP = "swap"
    """Copy it to the host tier and copy it back when the sequence runs again."""
    AUTO = "auto"
    """Per sequence, whichever the measured cost model (`swap_cost.py`) says is cheaper."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    num_blocks: int
    """KV blocks in the cache; must hold at least one sequence of `max_model_len` tokens."""
    block_size: int = 16
    """Tokens per KV block."""
    max_num_seqs: int = 64
    """Most sequences running (holding KV) at once."""
    max_num_batched_tokens: int = 512
    """Token budget of one step; long prompts are prefilled in chunks of at most this many tokens."""
    max_model_len: int = 2048
    """Most tokens (prompt and output) in one sequence."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose whole token prefix was computed before."""
    preemption_mode: PreemptionMode | str = PreemptionMode.RECOMPUTE
    """Accepts the enum or its value; stored as the enum."""
    kv_host_tier_mib: int = 0
    """Host memory (pinned on CUDA) for prefix-cache blocks evicted from the device and for swapped-out
    sequences; 0: no host tier."""
    kv_disk_tier_dir: str | None = None
    """Folder of the disk tier: prefix-cache blocks evicted from the host tier (or from the device when
    there is no host tier), kept across restarts, one subfolder per model fingerprint; None: no disk tier."""
    kv_disk_tier_mib: int = 4096
    """Most disk space the disk tier's block files take; the least recently used go first."""
    lanes: int = 1
    """Forwards run at once per step on CPU, each over a share of the batch and of torch's threads
    (`ModelRunner.set_lanes`). One (each op split over the threads) is fastest on cores the engine has to
    itself; the torch thread count holds up better where other work shares the cores."""
    adapt_threads: bool = False
    """Follow the cores free while stepping (`tether.models.governor`): one torch thread fewer when ours
    wait for a CPU, one more when a core stands idle. For an engine that owns the process's threads (a
    server); a benchmark or a trainer that splits threads itself leaves it off."""
    attention_block_tokens: int = 512
    """Query and KV tokens per tile of the block-wise (online-softmax) attention of a chunk whose context
    reaches `blockwise_min_context` (`tether.kernels.blockwise`): memory per layer is one tile's scores,
    whatever the context. A multiple of `block_size`; 0: such a chunk's whole [heads, Q, K] score matrix
    at once (the baseline the long-context bench compares with)."""
    blockwise_min_context: int = 4096
    """Chunks whose context (cached and new tokens) reaches this many tokens attend block-wise (or by the
    full matrix when `attention_block_tokens` is 0); shorter ones keep the per-row C kernel on CPU float32,
    whose logprobs the learner's dense forward reproduces bit for bit, or SDPA elsewhere."""

    def __post_init__(self) -> None:
        for name in (
            "num_blocks",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "lanes",
            "blockwise_min_context",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"engine: {name} = {value!r}: expected an integer of at least 1")
        tile = self.attention_block_tokens
        if isinstance(tile, bool) or not isinstance(tile, int) or tile < 0 or tile % self.block_size:
            raise ConfigError(
                f"engine: attention_block_tokens = {tile!r}: expected 0 (off: the full score matrix) or a "
                f"positive multiple of block_size ({self.block_size})"
            )
        if not isinstance(self.adapt_threads, bool):
            raise ConfigError(f"engine: adapt_threads = {self.adapt_threads!r}: expected true or false")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(
                f"engine: enable_prefix_caching = {self.enable_prefix_caching!r}: expected true or false"
            )
        try:
            mode = PreemptionMode(self.preemption_mode)
        except ValueError:
            accepted = ", ".join(repr(m.value) for m in PreemptionMode)
            raise ConfigError(
                f"engine: preemption_mode = {self.preemption_mode!r}: expected one of {accepted}"
            ) from None
        object.__setattr__(self, "preemption_mode", mode)
        self._check_tiers(mode)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"engine: max_num_batched_tokens = {self.max_num_batched_tokens}: expected at least "
                f"max_num_seqs ({self.max_num_seqs}), so that every running sequence can decode in one step"
            )
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        if self.num_blocks < blocks_per_seq:
            raise ConfigError(
                f"engine: num_blocks = {self.num_blocks}: expected at least {blocks_per_seq} "
                f"(max_model_len {self.max_model_len} / block_size {self.block_size}), "
                "so that one sequence of max_model_len tokens fits"
            )

    def _check_tiers(self, mode: PreemptionMode) -> None:
        for name in ("kv_host_tier_mib", "kv_disk_tier_mib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"engine: {name} = {value!r}: expected an integer of at least 0 (MiB)")
        directory = self.kv_disk_tier_dir
        if directory is not None and (not isinstance(directory, str) or not directory.strip()):
            raise ConfigError(f"engine: kv_disk_tier_dir = {directory!r}: expected a folder path or None")
        if directory is not None and self.kv_disk_tier_mib == 0:
            raise ConfigError(
                f"engine: kv_disk_tier_mib = 0 with kv_disk_tier_dir = {directory!r}: expected at least "
                "1 MiB of disk for the disk tier (or no kv_disk_tier_dir)"
            )
        if mode is not PreemptionMode.RECOMPUTE and self.kv_host_tier_mib == 0:
            raise ConfigError(
                f"engine: preemption_mode = {mode.value!r} swaps KV to the host tier: expected "
                "kv_host_tier_mib of at least 1 (or preemption_mode 'recompute')"
            )
        if directory is not None and not self.enable_prefix_caching:
            # (A host tier without prefix caching is still swap space.)
            raise ConfigError(
                f"engine: kv_disk_tier_dir = {directory!r} keeps evicted prefix-cache blocks: expected "
                "enable_prefix_caching = true"
            )

    @property
    def preemption(self) -> PreemptionMode:
        """`preemption_mode` as the enum (it is stored as one)."""
        assert isinstance(self.preemption_mode, PreemptionMode)
        return self.preemption_mode

    @property
    def max_blocks_per_seq(self) -> int:
        """Blocks one sequence of `max_model_len` tokens needs."""
        return -(-self.max_model_len // self.block_size)
