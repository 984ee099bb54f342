"""Load our own model implementation from a local Hugging Face folder, a registered model name or a run.

Weights are read from safetensors straight into parameters (the model is built on the meta device first),
so loading takes about as long as reading the file. Tokenizers come from transformers, offline.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from tether.errors import ConfigError
from tether.models.cache import Progress, pull
from tether.models.checkpoints import export_checkpoint, find_checkpoint
from tether.models.config import ModelConfig, RopeScaling, UnsupportedModelError
from tether.models.quantize import get_quantizer
from tether.models.registry import KNOWN_MODELS, lookup
from tether.models.transformer import CausalLM

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Checkpoints from older transformers versions carry these buffers; we recompute them.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def resolve(
    path_or_name: str | Path, cache_dir: Path | None = None, progress: Progress = lambda _: None
) -> Path:
    """The model folder `--model` names, wherever a model is loaded for the engine or a learner: a trained
    run's checkpoint (`runs/NAME`, `.../checkpoints/latest`, `.../checkpoints/step-NNNNNN`) exported onto
    its base model (`tether.models.checkpoints`), an existing local folder as is, or a registered name
    pulled into the cache."""
    path = Path(path_or_name)
    checkpoint = find_checkpoint(path)
    if checkpoint is not None:
        return export_checkpoint(
            checkpoint, lambda base, run_cache: resolve(base, run_cache or cache_dir, progress), progress
        )
    if path.is_dir():
        return path
    if len(path.parts) > 1:  # a path, not a name: say so rather than list the registered names
        raise ConfigError(
            f"unknown model {str(path)!r}: no such folder; expected a model folder, a run directory or one "
            f"of its checkpoints (runs/NAME/checkpoints/latest), or a registered model "
            f"({', '.join(KNOWN_MODELS)})"
        )
    source = lookup(str(path_or_name))  # an unknown name raises, naming the known ones
    if cache_dir is None:
        from tether.config import TetherSettings

        cache_dir = TetherSettings().cache_dir
    return pull(source.name, cache_dir, progress)


def load_weights(model: CausalLM, folder: Path, device: torch.device | str, dtype: torch.dtype) -> None:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{str(folder)!r} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file, device=str(device)))
    state = {k: v.to(dtype) for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected = {k for k in model.state_dict() if k != "lm_head.weight"}
    else:
        expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise UnsupportedModelError(
            f"weights in {str(folder)!r} do not fit {model.config.architecture}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return tokenizer


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a block that builds many objects and no garbage, then as
    it was. Building SmolLM2 and its tokenizer ran about 450 collections, 0.4-0.5 s of a 2.1-2.5 s load
    on 2 cores, each over every object the process holds; the next collection after the block sees
    whatever it left, so nothing is kept that would have been freed."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def load(
    path_or_name: str | Path,
    cache_dir: Path | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    quantization: str | None = None,
    rope_scaling: RopeScaling | None = None,
) -> tuple[CausalLM, PreTrainedTokenizerBase, ModelConfig]:
    """Our model (in eval mode, on `device`), its tokenizer and its config.

    `quantization`: None keeps the checkpoint's weights in `dtype`; "int8" quantizes the transformer
    blocks' Linear weights (see `tether.models.quantize`). `rope_scaling` replaces the folder's (its
    original length defaulting to the model's max_position_embeddings), e.g. YaRN to run past it.
    """
    quantizer = None if quantization is None else get_quantizer(quantization)  # fails before any loading
    with _collector_paused():
        folder = resolve(path_or_name, cache_dir)
        config = ModelConfig.from_folder(folder)
        if rope_scaling is not None:
            config = config.with_rope_scaling(rope_scaling)
        with torch.device("meta"):
            model = CausalLM(config)
        load_weights(model, folder, device, dtype)
        if quantizer is not None:
            quantizer(model)
        model.eval().requires_grad_(False)
        return model, load_tokenizer(folder), config
