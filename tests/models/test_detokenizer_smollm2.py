"""Incremental detokenization with SmolLM2's byte-level BPE tokenizer equals the whole-sequence decode."""

from __future__ import annotations

from pathlib import Path

from tether.engine.detokenizer import IncrementalDetokenizer

TEXT = "def f(x):\n    return x ** 2  # squares — naïve café, 東京 🚀\n<|im_end|> after a special token"


def test_every_prefix_matches_the_whole_decode(smollm2_folder: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(decode)
    for end in range(1, len(ids) + 1):
        shown, full = detokenizer.update(ids[:end]), decode(ids[:end])
        assert full.startswith(shown), (end, shown, full)
        if not full.endswith("\ufffd"):  # a token ending inside a character is held back, then caught up
            assert shown == full, (end, shown, full)
    assert detokenizer.text == decode(ids)
