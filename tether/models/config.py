"""The architecture of a causal LM as read from a Hugging Face `config.json`.

Only the fields our own model code uses are kept; anything we cannot honour (an unknown architecture, a
rope scaling we do not implement) is rejected here with a clear message rather than silently computing
something different. Sliding-window attention is read per layer exactly as transformers 5 decides it
(`layer_windows`): a query at position i then sees the keys at positions i - window + 1 .. i.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.errors import TetherError


class UnsupportedModelError(TetherError, ValueError):
    """A model folder or config describes something our model code does not implement."""


@dataclass(frozen=True, slots=True)
class ArchitectureTraits:
    """What distinguishes the supported decoder families; the rest of the code is shared."""

    qkv_bias: bool
    qk_norm: bool


# Extend by adding a row; the model code reads only these traits.
ARCHITECTURES: dict[str, ArchitectureTraits] = {
    "LlamaForCausalLM": ArchitectureTraits(qkv_bias=False, qk_norm=False),
    "MistralForCausalLM": ArchitectureTraits(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": ArchitectureTraits(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": ArchitectureTraits(qkv_bias=False, qk_norm=True),
}

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary frequency scaling; `llama3` fields are unused by the other types."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling type {self.rope_type!r} is not supported; accepted: {', '.join(ROPE_TYPES)}"
            )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    layer_windows: tuple[int | None, ...] = ()
    """Per layer, the sliding window in tokens (a query sees itself and the window - 1 keys before it),
    or None for full causal attention; empty: every layer full."""

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "query heads must be a multiple of KV heads"
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.num_layers)
        assert len(self.layer_windows) == self.num_layers, "one window (or None) per layer"
        assert all(w is None or w >= 1 for w in self.layer_windows), "windows are at least one token"

    @property
    def sliding_window(self) -> int | None:
        """The largest window of the sliding layers, or None when no layer slides."""
        windows = [w for w in self.layer_windows if w is not None]
        return max(windows) if windows else None

    @property
    def kv_window(self) -> int | None:
        """Tokens behind a query that some layer still attends to when every layer slides (KV before them
        can be dropped), or None when a layer attends to the whole context."""
        if any(w is None for w in self.layer_windows):
            return None
        return self.sliding_window

    @property
    def traits(self) -> ArchitectureTraits:
        return ARCHITECTURES[self.architecture]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architectures = raw.get("architectures") or []
        supported = [name for name in architectures if name in ARCHITECTURES]
        if not supported:
            raise UnsupportedModelError(
                f"architecture {architectures!r} is not supported; accepted: {', '.join(ARCHITECTURES)}"
            )
        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        # transformers 5 nests rope settings in `rope_parameters`; older folders use top-level keys.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = str(rope.get("rope_type") or rope.get("type") or "default")
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
        )
        return cls(
            architecture=supported[0],
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            eos_token_ids=eos_ids,
            layer_windows=layer_windows(raw, supported[0], int(raw["num_hidden_layers"])),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        path = folder / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{str(folder)!r} is not a model folder: it has no config.json")
        return cls.from_dict(json.loads(path.read_text()))


def layer_windows(raw: dict[str, Any], architecture: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers 5.24 decides it from a `config.json`.

    Mistral: `sliding_window` (when set) on every layer; `layer_types` is ignored there, as transformers
    does. Qwen2 and Qwen3: `sliding_window` counts only with `use_sliding_window`; `layer_types` names each
    layer's kind, else layers from `max_window_layers` (default 28) on slide. Llama has no window."""
    if architecture == "LlamaForCausalLM":
        return (None,) * num_layers
    window = raw.get("sliding_window")
    if architecture != "MistralForCausalLM" and not raw.get("use_sliding_window"):
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise UnsupportedModelError(f"sliding_window = {window!r}: expected a positive integer or null")
    if architecture == "MistralForCausalLM":
        return (window,) * num_layers
    kinds = raw.get("layer_types")
    if kinds is None:
        first = int(raw.get("max_window_layers", 28))
        return tuple(window if window is not None and i >= first else None for i in range(num_layers))
    accepted = ("full_attention", "sliding_attention")
    if len(kinds) != num_layers or any(kind not in accepted for kind in kinds):
        raise UnsupportedModelError(
            f"layer_types = {kinds!r}: expected {num_layers} entries, each one of {', '.join(accepted)}"
        )
    if window is None and "sliding_attention" in kinds:
        # transformers raises here too: a sliding layer needs a window.
        raise UnsupportedModelError(
            "layer_types names sliding_attention layers but no sliding_window is set "
            "(sliding_window null or use_sliding_window false)"
        )
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)
