"""Sliding-window attention (Mistral, Qwen2 with max_window_layers) against transformers 5 on tiny random
models with a 24-token window over ~100-token sequences: which layers slide, the paged prefill and decode,
the learner's dense forward, and its gradients."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tether.engine.model_runner import ModelRunner, SequenceChunk
from tether.kernels import attention
from tether.kernels.blockwise import LongChunkAttention
from tether.models import ModelConfig, load
from tether.models.config import layer_windows
from tether.models.dense import DenseBatch, hidden_states, token_logprobs
from tether.testing import TINY_WINDOW

WINDOWED = ["mistral", "qwen2-window"]
BLOCK_SIZE = 4


def reference(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def random_tokens(config: ModelConfig, count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(config.vocab_size) for _ in range(count)]


def transformers_windows(config: Any) -> tuple[int | None, ...]:
    """The window each layer of a transformers model config attends with, as its modeling code decides."""
    if type(config).__name__ == "MistralConfig":
        return tuple([config.sliding_window] * config.num_hidden_layers)
    return tuple(
        config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types
    )


@pytest.mark.parametrize(
    ("kind", "settings"),
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 2}),
        ("qwen2", {"use_sliding_window": False, "sliding_window": 24, "max_window_layers": 0}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16}),  # max_window_layers 28 > 4 layers
        (
            "qwen2",
            {
                "use_sliding_window": True,
                "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
            },
        ),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
        ("mistral", {"sliding_window": 24}),
        ("mistral", {"sliding_window": None}),
        ("llama", {}),
    ],
)
def test_layer_windows_follow_transformers(kind: str, settings: dict[str, Any]) -> None:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig, "llama": LlamaConfig}
    config = classes[kind](num_hidden_layers=4, **settings)
    architecture = {"qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "llama": "Llama"}[kind]
    raw = config.to_dict()
    ours = layer_windows(raw, f"{architecture}ForCausalLM", 4)
    expected = (None,) * 4 if kind == "llama" else transformers_windows(config)
    assert ours == expected


def test_windowed_tiny_models_slide_where_expected(tiny_model: Callable[[str], Path]) -> None:
    mistral = ModelConfig.from_folder(tiny_model("mistral"))
    assert mistral.layer_windows == (TINY_WINDOW, TINY_WINDOW)
    assert mistral.sliding_window == mistral.kv_window == TINY_WINDOW
    qwen = ModelConfig.from_folder(tiny_model("qwen2-window"))
    assert qwen.layer_windows == (None, TINY_WINDOW)
    assert qwen.sliding_window == TINY_WINDOW and qwen.kv_window is None


@pytest.mark.parametrize("architecture", WINDOWED)
@pytest.mark.parametrize("chunk", [100, 13])
@pytest.mark.parametrize("path", ["kernel", "sdpa", "blockwise"])
def test_paged_prefill_past_the_window_matches_transformers(
    architecture: str,
    chunk: int,
    path: str,
    tiny_model: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every position of a 100-token prompt, prefilled in one chunk or in chunks of 13 (starts that are
    not multiples of the block size or the window), through the per-row C kernel, SDPA (as on a GPU) or
    block-wise attention (8-token tiles)."""
    if path == "sdpa":
        monkeypatch.setattr(attention, "kernel_for", lambda *_: attention.AttentionKernel.TORCH_SDPA)
    folder = tiny_model(architecture)
    model, _, config = load(folder)
    runner = ModelRunner(model, num_blocks=40, block_size=BLOCK_SIZE)
    if path == "blockwise":
        runner.long_chunks = LongChunkAttention(block_tokens=8, min_context=1)
    tokens = random_tokens(config, 100, seed=1)
    table = list(range(39, 14, -1))  # 25 blocks, descending ids
    logits = []
    for start in range(0, len(tokens), chunk):
        piece = tokens[start : start + chunk]
        batch = runner.make_batch([SequenceChunk(piece, start, table, all_logits=True)])
        logits.append(runner.run(batch))
    with torch.no_grad():
        theirs = reference(folder)(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(torch.cat(logits), theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("architecture", WINDOWED)
def test_greedy_decode_past_the_window_equals_transformers_forward(
    architecture: str, tiny_model: Callable[[str], Path]
) -> None:
    """Each greedy token decoded over the paged cache is the argmax of transformers' forward over the
    sequence so far. (Not `generate`: in transformers 5.24 it departs from its own forward for a Qwen2
    model mixing full and sliding layers once the context passes the window; for Mistral it agrees.)"""
    folder = tiny_model(architecture)
    model, _, config = load(folder)
    runner = ModelRunner(model, num_blocks=64, block_size=BLOCK_SIZE)
    prompts = [random_tokens(config, n, seed=n) for n in (10, 30)]
    ours = runner.generate_greedy(prompts, max_new_tokens=40, prefill_chunk=7)
    hf = reference(folder)
    for prompt, generated in zip(prompts, ours, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
        assert generated == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("architecture", WINDOWED)
@pytest.mark.parametrize("device_path", ["kernel", "sdpa"])
def test_dense_forward_past_the_window_matches_transformers(
    architecture: str, device_path: str, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The learner's forward, through the engine's C kernel (CPU float32) and through SDPA (as on a GPU),
    over a padded batch of a 100-token and a 37-token sequence."""
    folder = tiny_model(architecture)
    model, _, config = load(folder)
    sequences = [random_tokens(config, 100, seed=2), random_tokens(config, 37, seed=3)]
    batch = DenseBatch.padded(sequences)
    if device_path == "sdpa":
        monkeypatch.setattr("tether.models.dense.kernel_for", lambda *_: attention.AttentionKernel.TORCH_SDPA)
    with torch.no_grad():
        ours = model.lm_head(hidden_states(model, batch))
        theirs = reference(folder)(torch.tensor([sequences[0]])).logits[0]
        short = reference(folder)(torch.tensor([sequences[1]])).logits[0]
    torch.testing.assert_close(ours[0], theirs, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours[1, :37], short, atol=1e-4, rtol=1e-4)


def test_dense_windowed_blocks_hold_tokens_times_window_not_length_squared() -> None:
    batch = DenseBatch.padded([[1] * 1000])
    (block,) = batch.attention_blocks(window=24)
    assert block.score_elements <= 1000 * 2 * 24
    (full,) = batch.attention_blocks()
    assert full.score_elements == 1000 * 1000
    keys, _ = batch.key_tables(window=24)
    assert keys.shape == (1000, 24)


@pytest.mark.parametrize("architecture", WINDOWED)
def test_dense_gradients_past_the_window_match_transformers(
    architecture: str, tiny_model: Callable[[str], Path]
) -> None:
    folder = tiny_model(architecture)
    model, _, config = load(folder)
    hf = reference(folder)
    tokens = random_tokens(config, 90, seed=4)
    model.requires_grad_(True)
    (ours,) = token_logprobs(model, DenseBatch.padded([tokens]), [(1, 90)])
    torch.autograd.backward(ours.sum())
    logits = hf(torch.tensor([tokens])).logits[0, :-1]
    theirs = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens[1:])[:, None]).sum()
    torch.autograd.backward(theirs)
    name = "model.layers.1.self_attn.q_proj.weight"
    mine = dict(model.named_parameters())[name].grad
    reference_grad = dict(hf.named_parameters())[name].grad
    assert mine is not None and reference_grad is not None
    torch.testing.assert_close(mine, reference_grad, atol=1e-4, rtol=1e-3)


def test_shared_prefix_layout_respects_the_window(tiny_model: Callable[[str], Path]) -> None:
    """A prompt's samples see only the last window of the prompt: the shared-prefix layout (contexts)
    gives the logprobs the padded one does."""
    model, _, config = load(tiny_model("mistral"))
    prefix = random_tokens(config, 50, seed=5)
    continuations = [random_tokens(config, 30, seed=6), random_tokens(config, 7, seed=7)]
    targets = [(50, 80), (50, 57)]
    with torch.no_grad():
        shared = token_logprobs(model, DenseBatch.shared_prefix([(prefix, continuations)]), targets)
        padded = token_logprobs(model, DenseBatch.padded([prefix + c for c in continuations]), targets)
    for a, b in zip(shared, padded, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
