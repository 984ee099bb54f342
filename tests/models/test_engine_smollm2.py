"""The engine on the real SmolLM2: continuous batching with chunked prefill and a shared system prompt
gives the same greedy tokens as the model runner's plain batched decode (itself equal to transformers);
with YaRN it runs past its 8192 positions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tether.engine.context_limits import resolve_max_model_len
from tether.engine.llm_engine import LLMEngine
from tether.engine.model_runner import ModelRunner
from tether.engine.sampling import SamplingParams
from tether.errors import ConfigError
from tether.models.config import ModelConfig, RopeScaling

SYSTEM = "You are a concise assistant. Answer in one short sentence, without preamble or lists."
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?"]


def test_engine_greedy_equals_plain_batched_decode(smollm2_folder: Path) -> None:
    engine, tokenizer = LLMEngine.from_pretrained(
        smollm2_folder, kv_cache_mib=64, max_num_batched_tokens=48, max_num_seqs=8
    )
    prompts: list[list[int]] = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for question in QUESTIONS
    ]
    first = engine.generate(prompts[:1], SamplingParams(max_tokens=24, temperature=0))
    rest = engine.generate(prompts[1:], SamplingParams(max_tokens=24, temperature=0))
    outputs = first + rest
    reference = ModelRunner(engine.runner.model, num_blocks=64, block_size=16).generate_greedy(
        prompts, max_new_tokens=24, eos_token_ids=engine.eos_token_ids
    )
    assert [o.completions[0].token_ids for o in outputs] == reference
    assert all(o.num_cached_tokens >= 16 for o in rest), [o.num_cached_tokens for o in rest]
    assert "Paris" in outputs[0].completions[0].text


def test_smollm2_reaches_32k_only_with_rope_scaling(smollm2_folder: Path) -> None:
    """Its 8192 positions hold 32768 tokens with `yarn:4`, given the KV cache they need."""
    config = ModelConfig.from_folder(smollm2_folder)
    with pytest.raises(ConfigError, match=r"context limit of 8,192 positions.*--rope-scaling yarn:4"):
        resolve_max_model_len(config, 32768, 1440, 16, torch.float32)
    yarn = config.with_rope_scaling(RopeScaling.parse("yarn:4"))
    assert yarn.context_limit == 32768
    assert resolve_max_model_len(yarn, 32768, 720, 16, torch.bfloat16) == 32768


@pytest.mark.slow
def test_smollm2_with_yarn_continues_a_prompt_past_its_original_context(smollm2_folder: Path) -> None:
    """A 9000-token prompt, past SmolLM2's 8192 positions: YaRN keeps the continuation on track (about
    five minutes on two busy cores)."""
    engine, tokenizer = LLMEngine.from_pretrained(
        smollm2_folder,
        kv_cache_mib=720,
        dtype=torch.bfloat16,
        rope_scaling=RopeScaling.parse("yarn:4"),
        max_model_len=32768,
        max_num_batched_tokens=2048,
    )
    prompt = tokenizer("The quick brown fox jumps over the lazy dog. " * 1000)["input_ids"][:9000]
    (output,) = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0))
    assert "quick brown fox" in output.completions[0].text
