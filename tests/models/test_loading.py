"""Loading by folder or name, and the errors for what we cannot load."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tether.models import ModelConfig, UnknownModelError, UnsupportedModelError, list_cached, load, pull


def test_unknown_model_name_names_the_known_models(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match=r"'gpt-17'.*smollm2-135m-instruct"):
        load("gpt-17", cache_dir=tmp_path)
    with pytest.raises(UnknownModelError, match="gpt-17"):
        pull("gpt-17", tmp_path)


def test_a_misspelt_model_name_suggests_the_model_meant(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match=r"'smolm2-135m'; did you mean 'smollm2-135m-instruct'\?"):
        load("smolm2-135m", cache_dir=tmp_path)


def test_empty_cache_lists_nothing(tmp_path: Path) -> None:
    assert list_cached(tmp_path) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GemmaForCausalLM"]}, r"GemmaForCausalLM.*LlamaForCausalLM"),
        ({"architectures": []}, "not supported"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, r"'longrope'.*yarn, llama3"),
        ({"use_sliding_window": True, "sliding_window": 0}, "sliding_window = 0"),
        ({"layer_types": ["sliding_attention"] * 2}, "no sliding_window is set"),
        ({"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full"]}, "layer_types"),
    ],
)
def test_unsupported_configs_are_rejected_by_name(
    change: dict[str, object], message: str, tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model("qwen2"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UnsupportedModelError, match=message):
        load(folder)


def test_a_folder_without_config_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match=r"no config\.json"):
        ModelConfig.from_folder(tmp_path)


def test_weights_that_do_not_fit_the_architecture_are_rejected(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model("qwen2"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="missing"):
        load(folder)


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_tiny_models_load_with_their_chat_template(
    architecture: str, tiny_model: Callable[[str], Path]
) -> None:
    model, tokenizer, config = load(tiny_model(architecture))
    assert config.num_kv_heads < config.num_heads
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in text
    assert not any(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("enabled", [True, False])
def test_loading_pauses_garbage_collection_and_leaves_the_collector_as_it_was(
    tmp_path: Path, enabled: bool
) -> None:
    import gc

    from tether.testing import make_tiny_model

    folder = make_tiny_model(tmp_path, "llama", seed=0)
    collections: list[int] = []
    inside = [False]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and inside[0]:
            collections.append(info["generation"])

    gc.collect()
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    gc.callbacks.append(count)
    try:
        threshold = gc.get_threshold()
        gc.set_threshold(1)  # a collection at every new container, unless the loader pauses the collector
        inside[0] = True
        try:
            model, _, _ = load(folder)
            inside[0] = False
        finally:
            gc.set_threshold(*threshold)
        assert gc.isenabled() is enabled
    finally:
        gc.callbacks.remove(count)
        (gc.enable if was else gc.disable)()
    assert model.config.num_layers > 0
    # Entering and leaving the paused block allocates a few objects; without the pause, every one of the
    # thousands of objects the load builds would run a collection at this threshold.
    assert len(collections) < 20, f"{len(collections)} collections during the load"
