"""The architecture of a causal LM as read from a Hugging Face `config.json`.

Only the fields our own model code uses are kept; anything we cannot honour (an unknown architecture, a
rope scaling we do not implement or that lacks a field) is rejected here with a clear message rather than
silently computing something different. Sliding-window attention is read per layer exactly as
transformers 5 decides it (`layer_windows`): a query at position i then sees the keys at positions
i - window + 1 .. i.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from enum import StrEnum
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


class RopeType(StrEnum):
    """How rotary frequencies are scaled past the pretraining length (transformers' `rope_type`)."""

    DEFAULT = "default"
    LINEAR = "linear"
    DYNAMIC = "dynamic"
    YARN = "yarn"
    LLAMA3 = "llama3"


# Keys transformers requires (beyond rope_type) before it computes a type's frequencies; its own
# standardisation fills `original_max_position_embeddings` and `rope_theta`, so neither is required.
_REQUIRED_KEYS: dict[RopeType, tuple[str, ...]] = {
    RopeType.DEFAULT: (),
    RopeType.LINEAR: ("factor",),
    RopeType.DYNAMIC: ("factor",),
    RopeType.YARN: ("factor",),
    RopeType.LLAMA3: ("factor", "low_freq_factor", "high_freq_factor"),
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary frequency scaling as transformers 5.24 computes it (`modeling_rope_utils`); each type reads
    only its own fields. `dynamic` (NTK-aware) in transformers re-derives its base from the length of the
    sequence in every forward; an engine with a KV cache cannot re-rotate the keys it holds, so here (as
    in vLLM) the base is fixed for the longest sequence the scaling allows, `factor` times
    max_position_embeddings: transformers' result for a sequence of exactly that length."""

    rope_type: RopeType | str = RopeType.DEFAULT
    """Accepts the enum or its value; stored as the enum."""
    factor: float = 1.0
    """Context extension: positions supported are this many times the original length."""
    original_max_position_embeddings: int | None = None
    """Pretraining length (llama3, yarn); None: the model's max_position_embeddings (`resolved`).
    `dynamic` always reads the model's max_position_embeddings, as transformers does."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original length / this are divided by `factor`."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original length / this are kept; those between are interpolated."""
    beta_fast: float = 32.0
    """yarn: rotations below which a dimension starts to be interpolated (extrapolated above)."""
    beta_slow: float = 1.0
    """yarn: rotations below which a dimension is fully interpolated."""
    attention_factor: float | None = None
    """yarn: multiplier of cos and sin; None: derived from `factor` (and `mscale`, `mscale_all_dim`)."""
    mscale: float | None = None
    """yarn (DeepSeek): with `mscale_all_dim`, the numerator's coefficient of the derived attention factor."""
    mscale_all_dim: float | None = None
    """yarn (DeepSeek): with `mscale`, the denominator's coefficient of the derived attention factor."""
    truncate: bool = True
    """yarn: round the correction range outward to whole dimensions."""

    def __post_init__(self) -> None:
        try:
            kind = RopeType(self.rope_type)
        except ValueError:
            accepted = ", ".join(t.value for t in RopeType)
            raise UnsupportedModelError(
                f"rope scaling type {self.rope_type!r} is not supported; accepted: {accepted}"
            ) from None
        object.__setattr__(self, "rope_type", kind)
        number = isinstance(self.factor, int | float) and not isinstance(self.factor, bool)
        if not (number and math.isfinite(self.factor) and self.factor > 0):
            raise UnsupportedModelError(
                f"rope scaling {kind.value}: factor = {self.factor!r}: expected a positive number"
            )
        original = self.original_max_position_embeddings
        whole = isinstance(original, int) and not isinstance(original, bool)
        if original is not None and not (whole and original >= 1):
            raise UnsupportedModelError(
                f"rope scaling {kind.value}: original_max_position_embeddings = {original!r}: expected a "
                "positive integer"
            )
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise UnsupportedModelError(
                f"rope scaling {kind.value}: attention_factor = {self.attention_factor!r}: expected a "
                "positive number"
            )

    @classmethod
    def from_dict(cls, rope: dict[str, Any], max_position_embeddings: int | None = None) -> RopeScaling:
        """From a config's `rope_scaling`/`rope_parameters` object (the legacy `type` key included). A
        yarn `factor` of null is transformers' max_position_embeddings / original length."""
        kind_name = rope.get("rope_type") or rope.get("type") or RopeType.DEFAULT.value
        kind = cls(rope_type=str(kind_name)).rope_type  # an unknown type fails here, by name
        assert isinstance(kind, RopeType)
        missing = [key for key in _REQUIRED_KEYS[kind] if key not in rope]
        if missing:
            raise UnsupportedModelError(
                f"rope scaling {kind.value} needs {', '.join(missing)}; got {sorted(rope)}"
            )
        partial = rope.get("partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise UnsupportedModelError(
                f"rope scaling: partial_rotary_factor = {partial!r} is not supported; only 1.0 (every "
                "dimension rotated)"
            )
        original = _number(rope, "original_max_position_embeddings", kind)
        factor = _number(rope, "factor", kind)
        if factor is None and kind is RopeType.YARN and original and max_position_embeddings:
            factor = max_position_embeddings / original  # as transformers: the ratio of the two lengths
        if factor is None and kind is not RopeType.DEFAULT:
            raise UnsupportedModelError(
                f"rope scaling {kind.value}: factor = None: expected a positive number"
            )
        return cls(
            rope_type=kind,
            factor=1.0 if factor is None else factor,
            original_max_position_embeddings=None if original is None else _whole(original, kind),
            low_freq_factor=_number_or(rope, "low_freq_factor", kind, 1.0),
            high_freq_factor=_number_or(rope, "high_freq_factor", kind, 4.0),
            # transformers reads these two with `or`: a null or 0 takes the default
            beta_fast=_number(rope, "beta_fast", kind) or 32.0,
            beta_slow=_number(rope, "beta_slow", kind) or 1.0,
            attention_factor=_number(rope, "attention_factor", kind),
            mscale=_number(rope, "mscale", kind),
            mscale_all_dim=_number(rope, "mscale_all_dim", kind),
            truncate=bool(rope.get("truncate", True)),
        )

    @classmethod
    def parse(cls, text: str) -> RopeScaling:
        """The command-line form: a JSON object as in a config.json (`{"rope_type": "yarn", "factor": 4}`)
        or `TYPE:FACTOR` (`yarn:4`); `original_max_position_embeddings` defaults to the model's
        max_position_embeddings. `default` alone turns scaling off."""
        spec = text.strip()
        if spec.startswith("{"):
            try:
                raw = json.loads(spec)
            except json.JSONDecodeError as error:
                raise UnsupportedModelError(f"rope scaling {text!r} is not valid JSON: {error}") from None
            if not isinstance(raw, dict):
                raise UnsupportedModelError(f"rope scaling {text!r}: expected a JSON object")
            return cls.from_dict(raw)
        kind, colon, factor = spec.partition(":")
        if not colon and kind == RopeType.DEFAULT:
            return cls()
        accepted = "TYPE:FACTOR (e.g. yarn:4, with TYPE one of linear, dynamic, yarn) or a JSON object"
        try:
            value = float(factor)
        except ValueError:
            raise UnsupportedModelError(f"rope scaling {text!r}: expected {accepted}") from None
        if kind == RopeType.LLAMA3:
            raise UnsupportedModelError(
                f"rope scaling {text!r}: llama3 also needs low_freq_factor and high_freq_factor; give a JSON "
                "object"
            )
        return cls.from_dict({"rope_type": kind, "factor": value})

    def resolved(self, max_position_embeddings: int) -> RopeScaling:
        """This scaling with the original length filled in for a model of `max_position_embeddings`."""
        if self.rope_type is RopeType.DYNAMIC or self.original_max_position_embeddings is None:
            return replace(self, original_max_position_embeddings=max_position_embeddings)
        return self

    @property
    def original_length(self) -> int:
        assert self.original_max_position_embeddings is not None, "call `resolved` first"
        return self.original_max_position_embeddings

    @property
    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by: yarn's attention factor, 1 for the other types."""
        if self.rope_type is not RopeType.YARN:
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor, 1.0)

    def context_limit(self, max_position_embeddings: int) -> int:
        """Positions a model of `max_position_embeddings` supports with this scaling, by vLLM's rule:
        linear and dynamic stretch max_position_embeddings by `factor`, yarn stretches its original length
        (never below max_position_embeddings), llama3 and default keep max_position_embeddings (a llama3
        config's is already the extended length)."""
        if self.rope_type in (RopeType.LINEAR, RopeType.DYNAMIC):
            return int(max_position_embeddings * self.factor)
        if self.rope_type is RopeType.YARN:
            original = self.original_max_position_embeddings or max_position_embeddings
            return max(max_position_embeddings, int(original * self.factor))
        return max_position_embeddings

    def describe(self) -> str:
        """`yarn x4`, or `no rope scaling`: for messages."""
        if self.rope_type is RopeType.DEFAULT:
            return "no rope scaling"
        return f"{self.rope_type} x{self.factor:g}"


def _whole(value: float, kind: RopeType) -> int:
    if value != int(value):
        raise UnsupportedModelError(
            f"rope scaling {kind.value}: original_max_position_embeddings = {value!r}: expected an integer"
        )
    return int(value)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _number(rope: dict[str, Any], key: str, kind: RopeType) -> float | None:
    """`rope[key]` as a float, None when absent or null; a clear error for anything but a number."""
    raw = rope.get(key)
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise UnsupportedModelError(f"rope scaling {kind.value}: {key} = {raw!r}: expected a number")
    return float(raw)


def _number_or(rope: dict[str, Any], key: str, kind: RopeType, default: float) -> float:
    value = _number(rope, key, kind)
    return default if value is None else value


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
        object.__setattr__(self, "rope_scaling", self.rope_scaling.resolved(self.max_position_embeddings))
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.num_layers)
        assert len(self.layer_windows) == self.num_layers, "one window (or None) per layer"
        assert all(w is None or w >= 1 for w in self.layer_windows), "windows are at least one token"

    @property
    def context_limit(self) -> int:
        """Positions the model supports: max_position_embeddings, extended by its rope scaling
        (`RopeScaling.context_limit`)."""
        return self.rope_scaling.context_limit(self.max_position_embeddings)

    def kv_bytes_per_token(self, element_size: int) -> int:
        """KV cache bytes one token takes: a key and a value per layer and KV head, `head_dim` elements
        of `element_size` bytes each."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    def with_rope_scaling(self, scaling: RopeScaling) -> ModelConfig:
        """This model run with `scaling` instead of its config's (an explicit `--rope-scaling`)."""
        return replace(self, rope_scaling=scaling)

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
        # transformers 5 nests rope settings in `rope_parameters`; older folders use `rope_scaling`, which
        # transformers prefers when both are there, and a top-level `rope_theta`.
        rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
        if "partial_rotary_factor" in raw:
            rope.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        max_positions = int(raw.get("max_position_embeddings", 2048))
        scaling = RopeScaling.from_dict(rope, max_positions)
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
            max_position_embeddings=max_positions,
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
