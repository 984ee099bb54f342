"""RoPE scaling (linear, dynamic NTK, YaRN, llama3) against transformers 5.24 on tiny random models, over
sequences longer than the original context; the config and CLI forms, and the errors for bad ones."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tether.engine.llm_engine import LLMEngine
from tether.engine.model_runner import ModelRunner, SequenceChunk, make_batch
from tether.engine.sampling import SamplingParams
from tether.models import ModelConfig, UnsupportedModelError, load
from tether.models.config import RopeScaling, RopeType
from tether.models.dense import DenseBatch, token_logprobs

ORIGINAL = 64
"""The tiny models' max_position_embeddings here: every test sequence runs past it."""
TOKENS = 200
BLOCK_SIZE = 16
NUM_BLOCKS = 32

ROPES: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    # transformers re-derives dynamic's base per forward from the sequence length; ours is fixed for
    # factor x max_position_embeddings tokens (RopeScaling): the two agree on a sequence of that length.
    "dynamic": {"rope_type": "dynamic", "factor": TOKENS / ORIGINAL},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale-betas": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "yarn-attention-factor-untruncated": {
        "rope_type": "yarn",
        "factor": 3.0,
        "attention_factor": 0.8,
        "truncate": False,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}


def with_config(folder: Path, target: Path, **changes: Any) -> Path:
    """A copy of the model folder `folder` with its config.json changed (the weights are the same)."""
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))
    return target


def scaled_model(tiny_model: Callable[[str], Path], tmp_path: Path, architecture: str, rope: str) -> Path:
    theta = 10000.0 if architecture == "qwen2" else 500000.0
    return with_config(
        tiny_model(architecture),
        tmp_path / f"{architecture}-{rope}",
        max_position_embeddings=ORIGINAL,
        rope_parameters={**ROPES[rope], "rope_theta": theta},
    )


def reference(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def dense_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = hf(torch.tensor([tokens])).logits[0]
    return out


def random_tokens(vocab_size: int, count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(count)]


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_every_position_past_the_original_context_matches_transformers(
    architecture: str, rope: str, tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = scaled_model(tiny_model, tmp_path, architecture, rope)
    model, _, config = load(folder)
    assert config.rope_scaling.rope_type == ROPES[rope]["rope_type"]
    runner = ModelRunner(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    tokens = random_tokens(config.vocab_size, TOKENS, seed=1)
    batch = make_batch([SequenceChunk(tokens, 0, list(range(NUM_BLOCKS)))], BLOCK_SIZE, "cpu")
    with torch.no_grad():
        ours = runner.model(batch.input_ids, batch.positions, batch.attention, runner.kv_cache)
    torch.testing.assert_close(ours, dense_logits(reference(folder), tokens), atol=1e-4, rtol=1e-4)


def test_yarn_changes_the_logits_past_the_original_context(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """The comparison above can fail: without the scaling, transformers' logits differ beyond its
    tolerance."""
    scaled = reference(scaled_model(tiny_model, tmp_path, "qwen2", "yarn"))
    plain = reference(tiny_model("qwen2"))
    tokens = random_tokens(scaled.config.vocab_size, TOKENS, seed=1)
    with pytest.raises(AssertionError, match="Mismatched elements"):
        torch.testing.assert_close(
            dense_logits(scaled, tokens), dense_logits(plain, tokens), atol=1e-4, rtol=1e-4
        )


def test_yarn_chunked_prefill_and_paged_decode_equal_the_dense_forward(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = scaled_model(tiny_model, tmp_path, "llama", "yarn")
    model, _, config = load(folder)
    hf = reference(folder)
    runner = ModelRunner(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    table = list(range(NUM_BLOCKS))
    random.Random(2).shuffle(table)
    tokens = random_tokens(config.vocab_size, TOKENS - 8, seed=3)
    for start in range(0, len(tokens), 48):  # chunked prefill: the last chunk's logits only
        logits = runner.step([SequenceChunk(tokens[start : start + 48], start, table)])
    for _ in range(8):  # greedy decode through the paged cache, past TOKENS - 8
        torch.testing.assert_close(logits[0], dense_logits(hf, tokens)[-1], atol=1e-4, rtol=1e-4)
        tokens.append(int(logits[0].argmax()))
        logits = runner.step([SequenceChunk(tokens[-1:], len(tokens) - 1, table)])
    torch.testing.assert_close(logits[0], dense_logits(hf, tokens)[-1], atol=1e-4, rtol=1e-4)


def test_a_legacy_rope_scaling_key_wins_over_rope_parameters_as_in_transformers(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = with_config(
        tiny_model("qwen2"),
        tmp_path / "legacy",
        max_position_embeddings=ORIGINAL,
        rope_scaling={"type": "yarn", "factor": 4.0},
        rope_theta=10000.0,
    )
    _, _, config = load(folder)
    assert config.rope_scaling == RopeScaling(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL
    )
    model, _, _ = load(folder)
    runner = ModelRunner(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    tokens = random_tokens(config.vocab_size, TOKENS, seed=4)
    logits = runner.step([SequenceChunk(tokens, 0, list(range(NUM_BLOCKS)))])
    torch.testing.assert_close(logits[0], dense_logits(reference(folder), tokens)[-1], atol=1e-4, rtol=1e-4)


def test_an_explicit_rope_scaling_overrides_the_folders(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """`load(..., rope_scaling=)` computes what transformers computes for a config that says so."""
    plain = with_config(tiny_model("qwen2"), tmp_path / "plain", max_position_embeddings=ORIGINAL)
    model, _, config = load(plain, rope_scaling=RopeScaling.parse("yarn:4"))
    assert config.rope_scaling.original_max_position_embeddings == ORIGINAL
    assert config.context_limit == 4 * ORIGINAL
    tokens = random_tokens(config.vocab_size, TOKENS, seed=5)
    batch = make_batch([SequenceChunk(tokens, 0, list(range(NUM_BLOCKS)))], BLOCK_SIZE, "cpu")
    runner = ModelRunner(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    with torch.no_grad():
        ours = runner.model(batch.input_ids, batch.positions, batch.attention, runner.kv_cache)
    expected = reference(scaled_model(tiny_model, tmp_path, "qwen2", "yarn"))
    torch.testing.assert_close(ours, dense_logits(expected, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("yarn:4", RopeScaling(rope_type=RopeType.YARN, factor=4.0)),
        (" linear:2.5 ", RopeScaling(rope_type=RopeType.LINEAR, factor=2.5)),
        ("dynamic:2", RopeScaling(rope_type=RopeType.DYNAMIC, factor=2.0)),
        ("default", RopeScaling()),
        (
            '{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 4096, "beta_fast": 8}',
            RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096, beta_fast=8.0),
        ),
        (
            '{"type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4}',
            RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0),
        ),
    ],
)
def test_the_command_line_forms_parse(text: str, expected: RopeScaling) -> None:
    assert RopeScaling.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("yarn", r"'yarn': expected TYPE:FACTOR"),
        ("yarn:", r"expected TYPE:FACTOR"),
        ("yarn:four", r"expected TYPE:FACTOR"),
        ("wavy:2", r"'wavy' is not supported; accepted: default, linear, dynamic, yarn, llama3"),
        ("yarn:0", r"factor = 0.0: expected a positive number"),
        ("linear:-2", r"factor = -2.0: expected a positive number"),
        ("yarn:nan", r"factor = nan: expected a positive number"),
        ("llama3:8", r"llama3 also needs low_freq_factor and high_freq_factor"),
        ("{not json", r"not valid JSON"),
        ('{"rope_type": "yarn"}', r"yarn needs factor"),
    ],
)
def test_bad_command_line_forms_are_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        RopeScaling.parse(text)


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "longrope", "factor": 2.0}, r"'longrope' is not supported; accepted: default, linear"),
        ({"type": "su"}, r"'su' is not supported"),
        ({"rope_type": "linear"}, r"linear needs factor"),
        ({"rope_type": "dynamic", "factor": None}, r"dynamic: factor = None: expected a positive number"),
        ({"rope_type": "yarn", "factor": 0}, r"yarn: factor = 0.0: expected a positive number"),
        ({"rope_type": "linear", "factor": -1.5}, r"factor = -1.5"),
        ({"rope_type": "linear", "factor": "4"}, r"linear: factor = '4': expected a number"),
        ({"rope_type": "llama3", "factor": 8.0}, r"llama3 needs low_freq_factor, high_freq_factor"),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
            r"original_max_position_embeddings = 0: expected a positive integer",
        ),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64.5},
            r"original_max_position_embeddings = 64.5: expected an integer",
        ),
        ({"rope_type": "yarn", "factor": 4.0, "attention_factor": -1}, r"attention_factor = -1.0"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, r"partial_rotary_factor"),
    ],
)
def test_bad_rope_configs_are_rejected_with_what_is_wrong(
    rope: dict[str, Any], message: str, tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = with_config(tiny_model("qwen2"), tmp_path / "bad", rope_parameters={**rope, "rope_theta": 1e4})
    with pytest.raises(UnsupportedModelError, match=message):
        load(folder)


def model_config(max_positions: int, rope: dict[str, Any]) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": max_positions,
            "rope_scaling": rope,
        }
    )


@pytest.mark.parametrize(
    ("max_positions", "rope", "limit"),
    [
        (8192, {}, 8192),
        (8192, {"rope_type": "yarn", "factor": 4.0}, 32768),
        (32768, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, 32768),
        (4096, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}, 8192),
        (2048, {"rope_type": "linear", "factor": 2.0}, 4096),
        (2048, {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}, 4096),
        (
            131072,
            {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
            131072,
        ),
    ],
)
def test_the_context_limit_follows_the_rope_scaling(
    max_positions: int, rope: dict[str, Any], limit: int
) -> None:
    assert model_config(max_positions, rope).context_limit == limit


def test_the_original_length_defaults_to_max_position_embeddings_and_dynamic_always_reads_it() -> None:
    assert model_config(512, {"type": "yarn", "factor": 2.0}).rope_scaling.original_length == 512
    dynamic = {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16}
    assert model_config(512, dynamic).rope_scaling.original_length == 512
    llama3 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    assert model_config(512, llama3).rope_scaling.original_length == 512


def test_a_yarn_factor_of_null_is_the_ratio_of_the_lengths_as_in_transformers() -> None:
    config = model_config(4096, {"type": "yarn", "factor": None, "original_max_position_embeddings": 1024})
    assert config.rope_scaling.factor == 4.0


def test_the_learners_dense_forward_recomputes_yarn_engine_logprobs(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """Past the original context the training forward (`models.dense`) rotates as the engine does."""
    folder = scaled_model(tiny_model, tmp_path, "qwen2", "yarn")
    engine, _ = LLMEngine.from_pretrained(folder, kv_cache_mib=4, max_model_len=TOKENS + 16, seed=3)
    prompt = random_tokens(engine.runner.config.vocab_size, TOKENS, seed=6)
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)
    (completion,) = engine.generate([prompt], params)[0].completions
    model, _, _ = load(folder)
    sequence = prompt + completion.token_ids
    with torch.no_grad():
        (ours,) = token_logprobs(model, DenseBatch.padded([sequence]), [(TOKENS, len(sequence))], 1.0)
    torch.testing.assert_close(ours, torch.tensor(completion.logprobs), atol=1e-5, rtol=0)
