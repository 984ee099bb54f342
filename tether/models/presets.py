"""Architectures known by name, without weights: the shapes of well-known models, for planning only.

Each preset is the `ModelConfig` its Hugging Face `config.json` gives (layers, widths, heads, vocabulary,
tied embeddings, Qwen2's q/k/v biases, Qwen3's q/k norms), so our `CausalLM` builds it on the meta device
and `memory_plan` counts its parameters without a download. Nothing here loads or allocates a model; a
preset is not something `tether.models.load` can run (it has no weights: see `registry` for those).
"""

from __future__ import annotations

from pathlib import Path

from tether.errors import ConfigError, did_you_mean
from tether.models.config import ModelConfig, RopeScaling

_LLAMA3_1_ROPE = RopeScaling(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)


def _config(
    architecture: str,
    *,
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    tied: bool,
    theta: float,
    eps: float,
    max_positions: int,
    eos: int,
    head_dim: int | None = None,
    rope: RopeScaling | None = None,
) -> ModelConfig:
    return ModelConfig(
        architecture=architecture,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        rms_norm_eps=eps,
        rope_theta=theta,
        rope_scaling=rope or RopeScaling(),
        tie_word_embeddings=tied,
        max_position_embeddings=max_positions,
        eos_token_ids=(eos,),
    )


def _llama3(
    hidden: int, intermediate: int, layers: int, heads: int, max_positions: int, rope: RopeScaling | None
) -> ModelConfig:
    return _config(
        "LlamaForCausalLM",
        vocab=128256,
        hidden=hidden,
        intermediate=intermediate,
        layers=layers,
        heads=heads,
        kv_heads=8,
        tied=False,
        theta=500000.0,
        eps=1e-5,
        max_positions=max_positions,
        eos=128001,
        rope=rope,
    )


def _qwen2_5(
    vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, tied: bool
) -> ModelConfig:
    return _config(
        "Qwen2ForCausalLM",
        vocab=vocab,
        hidden=hidden,
        intermediate=intermediate,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        tied=tied,
        theta=1000000.0,
        eps=1e-6,
        max_positions=32768 if tied else 131072,
        eos=151643,
    )


_SMOLLM2_135M = _config(
    "LlamaForCausalLM",
    vocab=49152,
    hidden=576,
    intermediate=1536,
    layers=30,
    heads=9,
    kv_heads=3,
    tied=True,
    theta=100000.0,
    eps=1e-5,
    max_positions=8192,
    eos=2,
)

# Values as in each model's published config.json.
PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": _SMOLLM2_135M,
    "smollm2-135m-instruct": _SMOLLM2_135M,  # the registered model (`registry`): same shape
    "llama-3-8b": _llama3(4096, 14336, 32, 32, 8192, None),
    "llama-3-70b": _llama3(8192, 28672, 80, 64, 8192, None),
    "llama-3.1-8b": _llama3(4096, 14336, 32, 32, 131072, _LLAMA3_1_ROPE),
    "llama-3.1-70b": _llama3(8192, 28672, 80, 64, 131072, _LLAMA3_1_ROPE),
    "qwen2.5-0.5b": _qwen2_5(151936, 896, 4864, 24, 14, 2, tied=True),
    "qwen2.5-7b": _qwen2_5(152064, 3584, 18944, 28, 28, 4, tied=False),
    "qwen2.5-72b": _qwen2_5(152064, 8192, 29568, 80, 64, 8, tied=False),
    "qwen3-8b": _config(
        "Qwen3ForCausalLM",
        vocab=151936,
        hidden=4096,
        intermediate=12288,
        layers=36,
        heads=32,
        kv_heads=8,
        head_dim=128,
        tied=False,
        theta=1000000.0,
        eps=1e-6,
        max_positions=40960,
        eos=151645,
    ),
}


def preset(name: str) -> ModelConfig:
    """The architecture named `name` (case-insensitive), or a ConfigError naming the closest preset."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown model architecture {name!r}{did_you_mean(name.lower(), PRESETS) or ';'} "
            f"known: {', '.join(PRESETS)} (or the path of a local Hugging Face model folder)"
        ) from None


def architecture(name_or_folder: str) -> ModelConfig:
    """A preset's architecture, or that of a local Hugging Face folder (its config.json only)."""
    if Path(name_or_folder).is_dir():
        return ModelConfig.from_folder(Path(name_or_folder))
    return preset(name_or_folder)
