"""Incremental detokenization equals decoding the whole sequence, one token at a time."""

from __future__ import annotations

import random

import pytest

from tether.engine.detokenizer import IncrementalDetokenizer
from tether.testing import make_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("tok"), "llama"))


def test_every_prefix_decodes_like_the_whole_sequence(tokenizer: object) -> None:
    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))  # type: ignore[attr-defined]

    text = "Café au lait, naïve résumé — 東京 🚀 emoji and  double  spaces\n\ttabs"
    ids = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    detokenizer = IncrementalDetokenizer(decode)
    for end in range(1, len(ids) + 1):
        shown = detokenizer.update(ids[:end])
        full = decode(ids[:end])
        assert full.startswith(shown), (end, shown, full)
        if not full.endswith("\ufffd"):
            assert shown == full
    assert detokenizer.text == text


def test_random_token_streams_never_emit_half_characters(tokenizer: object) -> None:
    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))  # type: ignore[attr-defined]

    vocab = len(tokenizer)  # type: ignore[arg-type]
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(vocab) for _ in range(40)]
        detokenizer = IncrementalDetokenizer(decode)
        for end in range(1, len(ids) + 1):
            assert decode(ids[:end]).startswith(detokenizer.update(ids[:end])), ids[:end]
