"""Named architectures: our `CausalLM` builds each one on the meta device with its published size."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tether.errors import ConfigError
from tether.models.memory_plan import meta_model, parameter_count
from tether.models.presets import PRESETS, architecture, preset
from tether.models.registry import KNOWN_MODELS
from tether.models.transformer import Attention

# (preset, size as its model card states it, the unit of that figure, decimals given)
PUBLISHED = [
    ("smollm2-135m", 135, 1e6, 0),
    ("llama-3-8b", 8.03, 1e9, 2),
    ("llama-3-70b", 70.6, 1e9, 1),
    ("llama-3.1-8b", 8.03, 1e9, 2),
    ("llama-3.1-70b", 70.6, 1e9, 1),
    ("qwen2.5-0.5b", 0.49, 1e9, 2),
    ("qwen2.5-7b", 7.61, 1e9, 2),
    ("qwen2.5-72b", 72.7, 1e9, 1),
    ("qwen3-8b", 8.2, 1e9, 1),
]


@pytest.mark.parametrize(("name", "published", "unit", "decimals"), PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_a_preset_built_on_the_meta_device_has_its_published_parameter_count(
    name: str, published: float, unit: float, decimals: int
) -> None:
    model = meta_model(preset(name))
    assert all(p.is_meta for p in model.parameters())
    assert abs(parameter_count(model) / unit - published) < 10**-decimals  # cards round or truncate


def test_every_preset_is_listed_with_its_published_size() -> None:
    assert {name for name, *_ in PUBLISHED} | {"smollm2-135m-instruct"} == set(PRESETS)


def test_qwen2_has_qkv_biases_and_ties_only_small_models() -> None:
    qwen = meta_model(preset("qwen2.5-7b"))
    attention = next(m for m in qwen.modules() if isinstance(m, Attention))
    assert attention.q_proj.bias is not None and attention.o_proj.bias is None
    assert qwen.lm_head.weight is not qwen.model.embed_tokens.weight
    small = meta_model(preset("qwen2.5-0.5b"))
    assert small.lm_head.weight is small.model.embed_tokens.weight


def test_every_registered_model_has_a_preset() -> None:
    assert set(KNOWN_MODELS) <= set(PRESETS)


def test_names_are_case_insensitive() -> None:
    assert preset("Llama-3-8B") == PRESETS["llama-3-8b"]


@pytest.mark.parametrize(("name", "suggestion"), [("lama-3-8b", "llama-3-8b"), ("qwen2.5-72", "qwen2.5-72b")])
def test_an_unknown_name_suggests_the_closest_and_lists_all(name: str, suggestion: str) -> None:
    with pytest.raises(ConfigError, match=f"did you mean '{suggestion}'") as error:
        preset(name)
    assert all(known in str(error.value) for known in PRESETS)


def test_a_name_nothing_is_close_to_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown model architecture 'gpt-5'; known: smollm2-135m"):
        architecture("gpt-5")


def test_a_local_folder_is_read_from_its_config(tiny_model: Callable[[str], Path]) -> None:
    folder = tiny_model("qwen2")
    config = architecture(str(folder))
    assert config.architecture == "Qwen2ForCausalLM"
    assert config.traits.qkv_bias
