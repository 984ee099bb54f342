"""A trained run's checkpoint as a model folder the engine loads.

`find_checkpoint` says whether a `--model` path names a run (`runs/NAME`, `runs/NAME/checkpoints`,
`.../checkpoints/latest`, `.../checkpoints/step-NNNNNN`) and which finished checkpoint it means; every
path that names a run but no usable checkpoint (none saved yet, a missing pointer, an unfinished `.tmp`)
is refused naming what exists. `export_checkpoint` turns it into a Hugging Face folder, `<checkpoint>/
model/`: the base model's config and tokenizer files with the trained weights (LoRA adapters merged into
the base projections), built in a temporary folder and renamed into place, so a folder that exists is
complete and a second load reads it at once; it lives and is deleted with its checkpoint (a re-saved or
rotated step drops it). The base model is the `[model] name` of the run's `config.toml`.
This module writes no checkpoints and imports nothing from `tether.rl`: the layout it reads is the one
`tether.rl.checkpoint` writes, which imports these names from here.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import tomllib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tether.errors import ConfigError

CHECKPOINTS = "checkpoints"  # a run's checkpoints folder
LATEST = "latest"  # the pointer file naming a run's newest finished checkpoint
STATE = "state"  # the learner's model and optimizer, in torch.distributed.checkpoint's layout
RUN_CONFIG = "config.toml"  # the run's own config: `[model] name` is the base model
EXPORT = "model"  # the exported Hugging Face folder, inside its checkpoint
MANIFEST = "tether.json"  # what the exported folder was made from (written last, before the rename)
LORA_KEYS = ("lora_a.", "lora_b.")  # the adapters' state: `lora_a.<module path, dots as />.weight`

_STEP = re.compile(r"step-\d+")
_TMP = ".tmp"

# The base model of a run: (its `[model] name`, the run's `[model] cache_dir`) -> its folder.
BaseResolver = Callable[[str, Path | None], Path]


@dataclass(frozen=True, slots=True)
class RunModel:
    """What a run's config says about the model it trains."""

    base: str  # a registered name or a model folder
    cache_dir: Path | None
    lora_scaling: float | None  # alpha / r of `[model.lora]`; None: a full fine-tune


def _listing(folder: Path) -> str:
    names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    return ", ".join(names) if names else "nothing"


def _finished(checkpoints: Path) -> str:
    """The finished checkpoints under `checkpoints`, for a message naming what a user could pass."""
    names = sorted(
        p.name for p in checkpoints.glob("step-*") if p.is_dir() and _STEP.fullmatch(p.name) is not None
    )
    return f"finished checkpoints: {', '.join(names)}" if names else "no checkpoint has finished"


def _latest(checkpoints: Path) -> Path:
    run_dir = checkpoints.parent
    if not checkpoints.is_dir():
        if not run_dir.is_dir():
            raise ConfigError(f"run directory {str(run_dir)!r} does not exist")
        raise ConfigError(
            f"run directory {str(run_dir)!r} has no {CHECKPOINTS}/ folder: the run has not saved a "
            f"checkpoint yet (it holds: {_listing(run_dir)})"
        )
    pointer = checkpoints / LATEST
    if not pointer.is_file():
        raise ConfigError(
            f"{str(pointer)!r} is missing ({_finished(checkpoints)}; the folder holds: "
            f"{_listing(checkpoints)})"
        )
    name = pointer.read_text().strip()
    if _STEP.fullmatch(name) is None:
        raise ConfigError(f"{str(pointer)!r} reads {name!r}: expected the name of a step-NNNNNN folder")
    return _step(checkpoints / name)


def _step(path: Path) -> Path:
    checkpoints = path.parent
    if path.name.endswith(_TMP):
        raise ConfigError(
            f"{str(path)!r} is an unfinished checkpoint (still being written, or left by a killed run); "
            f"{_finished(checkpoints)}"
        )
    if not path.is_dir():
        raise ConfigError(
            f"checkpoint {str(path)!r} does not exist; {str(checkpoints)!r} holds: {_listing(checkpoints)}"
        )
    if not (path / STATE).is_dir():
        raise ConfigError(
            f"checkpoint {str(path)!r} has no {STATE}/ folder of model weights (it holds: {_listing(path)})"
        )
    return path


def find_checkpoint(path: Path) -> Path | None:
    """The finished checkpoint folder `path` names, or None when `path` names no run (a model folder or a
    registered name). A path shaped like a run's that names no usable checkpoint raises `ConfigError`."""
    if path.name == LATEST and path.parent.name == CHECKPOINTS:
        return _latest(path.parent)
    if path.parent.name == CHECKPOINTS and _STEP.fullmatch(path.name.removesuffix(_TMP)) is not None:
        return _step(path)
    if path.name == CHECKPOINTS and (path.parent / RUN_CONFIG).is_file():
        return _latest(path)
    if path.is_dir() and (path / RUN_CONFIG).is_file() and not (path / "config.json").is_file():
        return _latest(path / CHECKPOINTS)
    return None


def read_run_model(checkpoint: Path) -> RunModel:
    """The model section of the config of the run that wrote `checkpoint`."""
    config_path = checkpoint.parent.parent / RUN_CONFIG
    if not config_path.is_file():
        raise ConfigError(
            f"{str(config_path)!r} is missing: it names the base model the run trained, which checkpoint "
            f"{str(checkpoint)!r} needs"
        )
    try:
        model = tomllib.loads(config_path.read_text()).get("model", {})
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"run config {str(config_path)!r} is not valid TOML: {error}") from None
    base = model.get("name") if isinstance(model, dict) else None
    if not isinstance(base, str) or not base:
        raise ConfigError(f"run config {str(config_path)!r} has no [model] name: the base model is unknown")
    cache_dir = model.get("cache_dir")
    lora = model.get("lora")
    scaling = None if not isinstance(lora, dict) else float(lora["alpha"]) / float(lora["r"])
    return RunModel(base, Path(cache_dir) if isinstance(cache_dir, str) else None, scaling)


def checkpoint_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model tensors a checkpoint holds, by name, on the CPU: what trained (LoRA:
    the adapters), whatever world size wrote it."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    reader = FileSystemReader(checkpoint / STATE)
    wanted = {
        key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # DCP warns that it assumes one process: here, that is what is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp_load({"model": wanted}, storage_reader=reader, no_dist=True)
    return wanted


def trained_weights(
    base: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], lora_scaling: float | None
) -> dict[str, torch.Tensor]:
    """The base weights with what trained applied: a full fine-tune's tensors replace theirs; LoRA
    adapters are merged as peft does, W + scaling * B @ A (the weights the learner pushes to its engine).
    A name the base model lacks is refused, except a tied output head the base file leaves out."""
    weights = dict(base)
    if lora_scaling is None:
        for name, tensor in saved.items():
            if name not in base:
                if name == "lm_head.weight":  # tied to the embedding, which the checkpoint also holds
                    continue
                raise ConfigError(f"the checkpoint holds {name!r}, which the base model does not have")
            weights[name] = tensor
        return weights
    stray = sorted(name for name in saved if not name.startswith(LORA_KEYS))
    if stray:
        raise ConfigError(f"the run trains LoRA adapters but its checkpoint holds {stray[:3]}")
    for key, a in saved.items():
        if not key.startswith(LORA_KEYS[0]):
            continue
        module = key.removeprefix(LORA_KEYS[0]).removesuffix(".weight").replace("/", ".")
        b = saved.get(f"{LORA_KEYS[1]}{key.removeprefix(LORA_KEYS[0])}")
        name = f"{module}.weight"
        if b is None or name not in base:
            raise ConfigError(f"adapter {key!r} has no matching lora_b or base weight {name!r}")
        weights[name] = base[name].to(a.dtype) + (b @ a) * lora_scaling
    return weights


def _copy_base_files(base: Path, dest: Path) -> None:
    for file in base.iterdir():
        weights = file.name.endswith((".safetensors", ".safetensors.index.json"))
        if file.is_file() and not weights and file.name != MANIFEST:
            shutil.copy2(file, dest / file.name)


def export_checkpoint(
    checkpoint: Path, resolve_base: BaseResolver, progress: Callable[[str], None] = lambda _: None
) -> Path:
    """`checkpoint`'s model as a Hugging Face folder (`<checkpoint>/model/`), exported on first use."""
    dest = checkpoint / EXPORT
    if (dest / MANIFEST).is_file():
        return dest
    run = read_run_model(checkpoint)
    base = resolve_base(run.base, run.cache_dir)
    progress(f"exporting {checkpoint} onto {run.base}")
    base_state: dict[str, torch.Tensor] = {}
    for file in sorted(base.glob("*.safetensors")):
        base_state.update(load_file(file))
    weights = trained_weights(base_state, checkpoint_tensors(checkpoint), run.lora_scaling)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EXPORT}-", dir=checkpoint))
    try:
        _copy_base_files(base, tmp)
        save_file({name: t.contiguous() for name, t in weights.items()}, tmp / "model.safetensors")
        manifest: dict[str, Any] = {
            "run": str(checkpoint.parent.parent),
            "checkpoint": checkpoint.name,
            "base": run.base,
            "lora_scaling": run.lora_scaling,
            "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        try:
            tmp.rename(dest)
        except OSError:  # another process exported it first: its folder is complete, keep it
            if not (dest / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
