"""Our paged forward against transformers' reference implementation, on tiny random checkpoints."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tether.engine.model_runner import ModelRunner, SequenceChunk, WeightUpdateError, make_batch
from tether.kernels import attention, cpu
from tether.kernels.attention import AttentionKernel, attention_kernel
from tether.kernels.cpu import CpuFeature
from tether.models import ModelConfig, load, prepack
from tether.models.prepack import ProjectionKernel, projection_kernel

ARCHITECTURES = ["llama", "qwen2", "qwen3"]
BLOCK_SIZE = 4
NUM_BLOCKS = 64


def reference(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def reference_last_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = hf(torch.tensor([tokens])).logits[0, -1]
    return out


def ours_and_reference(folder: Path) -> tuple[ModelConfig, Any, ModelRunner]:
    """The model's config, the transformers reference, and a runner over our model and a fresh paged cache."""
    model, _, config = load(folder)
    return config, reference(folder), ModelRunner(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)


def scattered_blocks(seed: int) -> list[int]:
    """Block ids in shuffled order, so consecutive blocks of a sequence are far apart in the cache."""
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    return blocks


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_chunked_prefill_and_paged_decode_match_transformers(
    architecture: str, tiny_model: Callable[[str], Path]
) -> None:
    config, hf, runner = ours_and_reference(tiny_model(architecture))
    rng = random.Random(1)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in (5, 9, 13)]
    free = scattered_blocks(seed=2)
    tables = [[free.pop() for _ in range(8)] for _ in prompts]
    assert all(t != sorted(t) for t in tables), "block tables should be non-contiguous"

    # Step 1: prompt 0 whole, the first 4 tokens of prompt 1 (no logits yet), prompt 2 whole.
    logits = runner.step(
        [
            SequenceChunk(prompts[0], 0, tables[0]),
            SequenceChunk(prompts[1][:4], 0, tables[1], needs_logits=False),
            SequenceChunk(prompts[2], 0, tables[2]),
        ]
    )
    assert logits.shape == (2, config.vocab_size)
    for row, seq in zip(logits, (prompts[0], prompts[2]), strict=True):
        torch.testing.assert_close(row, reference_last_logits(hf, seq), atol=1e-4, rtol=1e-4)

    # Step 2: the rest of prompt 1 alongside one decode token for prompts 0 and 2.
    texts = [list(p) for p in prompts]
    texts[0].append(7)
    texts[2].append(11)
    logits = runner.step(
        [
            SequenceChunk([7], len(prompts[0]), tables[0]),
            SequenceChunk(prompts[1][4:], 4, tables[1]),
            SequenceChunk([11], len(prompts[2]), tables[2]),
        ]
    )
    for row, seq in zip(logits, texts, strict=True):
        torch.testing.assert_close(row, reference_last_logits(hf, seq), atol=1e-4, rtol=1e-4)

    # Steps 3-6: greedy decode of all three through the cache, crossing block boundaries.
    for _ in range(4):
        next_tokens = logits.argmax(dim=-1).tolist()
        chunks = []
        for i, token in enumerate(next_tokens):
            chunks.append(SequenceChunk([token], len(texts[i]), tables[i]))
            texts[i].append(token)
        logits = runner.step(chunks)
        for row, seq in zip(logits, texts, strict=True):
            torch.testing.assert_close(row, reference_last_logits(hf, seq), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_prompt_position_matches_transformers(
    architecture: str, tiny_model: Callable[[str], Path]
) -> None:
    config, hf, runner = ours_and_reference(tiny_model(architecture))
    tokens = [random.Random(3).randrange(config.vocab_size) for _ in range(10)]
    chunk = SequenceChunk(tokens, 0, scattered_blocks(seed=4)[:3])
    batch = make_batch([chunk], BLOCK_SIZE, "cpu")
    with torch.no_grad():
        ours = runner.model(batch.input_ids, batch.positions, batch.attention, runner.kv_cache)
        theirs = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_decode_equals_transformers_generate(
    architecture: str, tiny_model: Callable[[str], Path]
) -> None:
    config, hf, runner = ours_and_reference(tiny_model(architecture))
    rng = random.Random(5)
    prompts = [[rng.randrange(config.vocab_size - 3) for _ in range(n)] for n in (3, 8, 11)]
    ours = runner.generate_greedy(prompts, max_new_tokens=12, eos_token_ids=(), prefill_chunk=3)
    for prompt, generated in zip(prompts, ours, strict=True):
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
        assert generated == out[0, len(prompt) :].tolist()


def test_update_weights_changes_outputs_and_can_be_undone(tiny_model: Callable[[str], Path]) -> None:
    model, _, _ = load(tiny_model("qwen2"))
    runner = ModelRunner(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    prompt = [[5, 6, 7, 8, 9]]

    def logits() -> torch.Tensor:
        return runner.step([SequenceChunk(prompt[0], 0, [0, 1])])

    before = logits()
    name = "model.layers.1.mlp.down_proj.weight"
    original = dict(model.named_parameters())[name].detach().clone()
    assert runner.update_weights({name: torch.randn_like(original)}) == 1
    assert not torch.allclose(logits(), before)
    runner.update_weights([(name, original)])
    torch.testing.assert_close(logits(), before)


def test_update_of_a_tied_embedding_reaches_the_output_projection(tiny_model: Callable[[str], Path]) -> None:
    model, _, config = load(tiny_model("llama"))
    assert config.tie_word_embeddings
    runner = ModelRunner(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    new = torch.randn(config.vocab_size, config.hidden_size)
    runner.update_weights({"lm_head.weight": new})
    torch.testing.assert_close(model.model.embed_tokens.weight, new)


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [
        ("model.layers.9.mlp.down_proj.weight", (64, 128), "unknown parameter"),
        ("model.layers.0.mlp.down_proj.wieght", (64, 128), "unknown parameter"),
        ("", (1,), "unknown parameter"),
        ("model.layers.0.mlp.down_proj.weight", (128, 64), "has shape"),
        ("model.norm.weight", (65,), "has shape"),
    ],
)
def test_update_weights_rejects_bad_names_and_shapes_without_changing_anything(
    name: str, shape: tuple[int, ...], message: str, tiny_model: Callable[[str], Path]
) -> None:
    model, _, _ = load(tiny_model("qwen2"))
    runner = ModelRunner(model, num_blocks=4, block_size=BLOCK_SIZE)
    good = "model.layers.0.self_attn.q_proj.weight"
    before = dict(model.named_parameters())[good].detach().clone()
    with pytest.raises(WeightUpdateError, match=message):
        runner.update_weights([(good, torch.zeros_like(before)), (name, torch.zeros(shape))])
    torch.testing.assert_close(dict(model.named_parameters())[good], before)


def test_bfloat16_weights_and_cache_stay_close_to_float32(tiny_model: Callable[[str], Path]) -> None:
    folder = tiny_model("qwen3")
    chunk = SequenceChunk([3, 1, 4, 1, 5, 9, 2, 6], 0, [5, 2])
    full, _, _ = load(folder)
    half, _, _ = load(folder, dtype=torch.bfloat16)
    reference_logits = ModelRunner(full, num_blocks=8, block_size=BLOCK_SIZE).step([chunk])
    runner = ModelRunner(half, num_blocks=8, block_size=BLOCK_SIZE)
    assert runner.kv_cache.keys[0].dtype == torch.bfloat16
    torch.testing.assert_close(runner.step([chunk]), reference_logits, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    "removed",
    [set(), {CpuFeature.ONEDNN_BF16}, {CpuFeature.AVX2_FMA}, {CpuFeature.ONEDNN}, set(CpuFeature)],
    ids=["this-cpu", "no-onednn-bf16", "no-avx2", "no-onednn", "none"],
)
def test_every_cpu_path_takes_its_kernels_and_stays_close_to_transformers(
    dtype: torch.dtype,
    removed: set[CpuFeature],
    tiny_model: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """This machine with features taken away runs each fallback: an AVX2-only CPU packs no bfloat16
    weights, a CPU without AVX2 takes the C kernel's portable path, one without oneDNN plain F.linear."""
    features = cpu.detected() - removed
    monkeypatch.setattr(cpu, "detected", lambda: features)
    packed_calls, vector_flags = [], []
    linear, decode_attention = prepack.linear, attention._paged.decode_attention
    monkeypatch.setattr(prepack, "linear", lambda *a: packed_calls.append(1) or linear(*a))
    monkeypatch.setattr(
        attention._paged, "decode_attention", lambda *a: vector_flags.append(a[17]) or decode_attention(*a)
    )  # a[17]: `vector` (a[18]: `half`, a float16 cache)
    folder = tiny_model("qwen3")
    model, _, config = load(folder, dtype=dtype)
    runner = ModelRunner(model, num_blocks=8, block_size=BLOCK_SIZE)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    prefill = runner.step([SequenceChunk(prompt, 0, [5, 2, 7])])
    decoded = runner.step([SequenceChunk([7], len(prompt), [5, 2, 7])])

    hf = reference(folder)
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    for logits, tokens in ((prefill[0], prompt), (decoded[0], [*prompt, 7])):
        expected = reference_last_logits(hf, tokens)
        torch.testing.assert_close(logits.float(), expected, atol=tolerance, rtol=tolerance)
    packs = projection_kernel(features, dtype) is ProjectionKernel.ONEDNN_PACKED
    assert bool(packed_calls) == packs
    kernel = attention_kernel(features, dtype, config.head_dim)
    if kernel is AttentionKernel.TORCH_SDPA:
        assert vector_flags == []
    else:
        assert vector_flags and set(vector_flags) == {kernel is AttentionKernel.C_AVX2}
