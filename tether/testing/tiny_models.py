"""Tiny random Llama/Qwen2/Qwen3/Mistral checkpoints, saved as Hugging Face folders, built in a second.

Two layers, hidden size 64, grouped-query attention, seeded weights, and a byte-level tokenizer with a
chat template: enough for transformers and our loader to load the same model and compare outputs.
The weights are random: the text they produce is meaningless.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

TINY_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "qwen2-window")
TINY_WINDOW = 24
"""The sliding window of the windowed tiny models: every layer of `mistral`, the second of `qwen2-window`
(its `max_window_layers` is 1)."""
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _config(
    architecture: str, vocab_size: int, eos_token_id: int, max_position_embeddings: int = 2048
) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id,
    }
    if architecture == "llama":
        # Tied embeddings and llama3 rope scaling, as in small Llama checkpoints.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope)
    if architecture == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False, rope_parameters={"rope_theta": 10000.0})
    if architecture == "mistral":
        return MistralConfig(**common, sliding_window=TINY_WINDOW, rope_parameters={"rope_theta": 10000.0})
    if architecture == "qwen2-window":
        return Qwen2Config(
            **common,
            use_sliding_window=True,
            sliding_window=TINY_WINDOW,
            max_window_layers=1,
            rope_parameters={"rope_theta": 10000.0},
        )
    if architecture == "qwen3":
        return Qwen3Config(
            **common, head_dim=32, tie_word_embeddings=False, rope_parameters={"rope_theta": 1000000.0}
        )
    raise ValueError(f"unknown tiny architecture {architecture!r}; accepted: {', '.join(TINY_ARCHITECTURES)}")


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_model(
    directory: Path, architecture: str = "llama", seed: int = 0, max_position_embeddings: int = 2048
) -> Path:
    """Write a tiny random model of `architecture` into `directory` (created) and return it; its
    byte-level tokenizer reads a byte a token, so long prompts want a larger `max_position_embeddings`."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM

    tokenizer = _tokenizer()
    config = _config(
        architecture, len(tokenizer), tokenizer.eos_token_id, max_position_embeddings=max_position_embeddings
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # default init leaves norms at 1 and biases at 0: perturb them so both count
            for name, param in model.named_parameters():
                if name.endswith("norm.weight") or name.endswith(".bias"):
                    param.add_(torch.randn_like(param) * 0.1)
    finally:
        torch.random.set_rng_state(generator_state)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def make_tiny_classifier(
    directory: Path, architecture: str = "llama", num_labels: int = 1, seed: int = 0
) -> Path:
    """Write a tiny random `*ForSequenceClassification` model (a reward model when `num_labels` is 1)
    of `architecture` into `directory` (created), with the same tokenizer as `make_tiny_model`."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForSequenceClassification

    tokenizer = _tokenizer()
    config = _config(architecture, len(tokenizer), tokenizer.eos_token_id)
    config.num_labels = num_labels
    config.pad_token_id = tokenizer.pad_token_id  # "<|endoftext|>": never inside a rendered conversation
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # a score head of unit scale, so that scores spread over (0, 1)
            model.score.weight.normal_(0.0, 1.0 / model.config.hidden_size**0.5)
    finally:
        torch.random.set_rng_state(generator_state)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
