"""LoRA for the learner (peft): low-rank adapters on the projections of our `CausalLM`, the rest frozen.

`attach_lora` injects peft's LoRA layers into the model in place (the dense training forward runs through
them unchanged) and returns an `Adapters` module that holds only the adapter weights: what the optimizer
updates and what a checkpoint saves. `merged_weights` is what the rollout engine receives: for every
adapted projection, base weight + scaling * B @ A under the base name, so the engine needs no LoRA code.
This module knows nothing of runs, engines or checkpoints' files.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import torch

from tether.errors import ConfigError
from tether.rl.sections import LoraSection

ADAPTER = "default"  # peft's adapter name: one adapter per model


class Adapters(torch.nn.Module):
    """The adapter weights of a LoRA model, by adapted projection (state dict: adapters only)."""

    def __init__(self, layers: dict[str, Any]) -> None:
        super().__init__()
        self.names = list(layers)  # module paths in the model, e.g. model.layers.0.self_attn.q_proj
        # ModuleDict keys may not contain dots; the A and B modules are shared with the model, not copied.
        self.lora_a = torch.nn.ModuleDict({_key(n): layer.lora_A[ADAPTER] for n, layer in layers.items()})
        self.lora_b = torch.nn.ModuleDict({_key(n): layer.lora_B[ADAPTER] for n, layer in layers.items()})
        self._layers = layers


def _key(name: str) -> str:
    return name.replace(".", "/")


def _peft() -> Any:
    try:  # untyped: used as Any
        return importlib.import_module("peft")
    except ImportError as error:
        raise ConfigError(f"model.lora needs peft ({error}): pip install 'peft>=0.13,<1'") from None


def attach_lora(model: torch.nn.Module, config: LoraSection) -> Adapters:
    """Inject adapters into `model` in place, freeze every other weight; returns the adapters."""
    peft = _peft()
    lora_config = peft.LoraConfig(
        r=config.r,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        bias="none",
    )
    peft.inject_adapter_in_model(lora_config, model, adapter_name=ADAPTER)
    layers = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, peft.tuners.lora.LoraLayer)
    }
    assert layers, "peft injected no adapter although target_modules named projections"
    for param in model.parameters():
        param.requires_grad_(False)
    adapters = Adapters(layers)
    for param in adapters.parameters():
        param.requires_grad_(True)
    return adapters


def merged_weights(adapters: Adapters) -> Iterator[tuple[str, torch.Tensor]]:
    """(base name, base weight + adapter delta) of every adapted projection, detached."""
    with torch.no_grad():
        for name in adapters.names:
            layer = adapters._layers[name]
            yield f"{name}.weight", layer.base_layer.weight + layer.get_delta_weight(ADAPTER)
