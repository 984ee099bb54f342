"""The engine over long contexts: sliding-window models prefilled in chunks and decoded past the window,
with the blocks behind the window given back, and block-wise attention of long chunks on and off."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tether.engine.block_manager import NO_BLOCK, BlockManager
from tether.engine.llm_engine import LLMEngine
from tether.engine.sampling import SamplingParams
from tether.engine.sequence import Sequence
from tether.models import load
from tether.models.dense import DenseBatch, hidden_states
from tether.testing import TINY_WINDOW

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def windowed_engine(folder: Path) -> LLMEngine:
    """Blocks of 4 tokens, prompts prefilled in chunks of 32."""
    engine, _ = LLMEngine.from_pretrained(
        folder, kv_cache_mib=1, block_size=4, max_num_batched_tokens=32, max_num_seqs=4
    )
    return engine


def dense_greedy_tokens(folder: Path, sequence: list[int], prompt_len: int) -> list[int]:
    """The argmax after each prefix, from the learner's dense forward over the whole sequence."""
    model, _, _ = load(folder)
    with torch.no_grad():
        logits = model.lm_head(hidden_states(model, DenseBatch.padded([sequence])))[0]
    return [int(t) for t in logits[prompt_len - 1 : -1].argmax(dim=-1)]


@pytest.mark.parametrize("architecture", ["mistral", "qwen2-window"])
def test_chunked_prefill_and_decode_past_the_window_equal_the_dense_forward(
    architecture: str, tiny_model: Callable[[str], Path]
) -> None:
    folder = tiny_model(architecture)
    engine = windowed_engine(folder)
    prompts = [[random.Random(n).randrange(250) for _ in range(n)] for n in (100, 61)]
    outputs = engine.generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs, strict=True):
        generated = output.completions[0].token_ids
        assert generated == dense_greedy_tokens(folder, prompt + generated, len(prompt))


def test_blocks_behind_the_window_are_released_and_the_output_is_unchanged(
    tiny_model: Callable[[str], Path],
) -> None:
    """Mistral slides in every layer: a 140-token sequence holds about window / block_size blocks, not 35.
    Qwen2 with a full layer keeps them all."""
    folder = tiny_model("mistral")
    engine = windowed_engine(folder)
    prompt = [random.Random(9).randrange(250) for _ in range(100)]
    engine.add_request("long", prompt, GREEDY)
    held = []
    while engine.has_unfinished():
        engine.step()
        held.append(engine.block_manager.num_used_blocks)
    stats = engine.block_manager.stats()
    assert stats.window_released_blocks >= (140 - TINY_WINDOW) // 4 - 2
    assert max(held[-30:]) <= TINY_WINDOW // 4 + 2  # decoding: the window's blocks and the current one
    # The same request again: the prefix cache kept the released (computed) blocks findable.
    again = engine.generate([prompt], GREEDY)[0].completions[0].token_ids
    fresh = windowed_engine(folder).generate([prompt], GREEDY)[0]
    assert again == fresh.completions[0].token_ids
    assert fresh.completions[0].token_ids == dense_greedy_tokens(
        folder, prompt + fresh.completions[0].token_ids, 100
    )
    full = windowed_engine(tiny_model("qwen2-window"))
    full.generate([prompt], GREEDY)
    assert full.block_manager.stats().window_released_blocks == 0


def test_release_behind_window_keeps_the_table_positional_and_frees_once() -> None:
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    seq = Sequence(0, "r", list(range(30)))
    manager.allocate(seq, 30)
    seq.num_computed_tokens = 30
    table = list(seq.block_table)
    assert manager.release_behind_window(seq, window=9) == 5  # positions 0..19 are behind 30 - 9 + 1 = 22
    assert seq.block_table[:5] == [NO_BLOCK] * 5 and seq.block_table[5:] == table[5:]
    assert manager.num_used_blocks == 3
    assert manager.release_behind_window(seq, window=9) == 0
    child = Sequence(1, "r", list(range(30)))
    manager.fork(seq, child)
    manager.free(seq)
    manager.free(child)
    assert manager.num_used_blocks == 0
    assert manager.stats().window_released_blocks == 5


def greedy_with_and_without_long_chunk_path(
    folder: Path, prompt_len: int, block_tokens: int, min_context: int
) -> list[tuple[list[int], list[float]]]:
    prompt = [random.Random(3).randrange(250) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = []
    for threshold in (min_context, 10**6):  # on, then off (no chunk reaches a million tokens)
        engine, _ = LLMEngine.from_pretrained(
            folder,
            kv_cache_mib=8,
            max_model_len=prompt_len + 16,  # within the tiny models' 2,048 positions
            attention_block_tokens=block_tokens,
            blockwise_min_context=threshold,
        )
        completion = engine.generate([prompt], params)[0].completions[0]
        outputs.append((completion.token_ids, completion.logprobs))
    return outputs


@pytest.mark.parametrize("block_tokens", [0, 128])
def test_long_prompt_greedy_output_is_the_same_with_blockwise_attention_on_and_off(
    block_tokens: int, tiny_model: Callable[[str], Path]
) -> None:
    """A 1200-token prompt in 512-token chunks, the last two over contexts from 512 tokens: block-wise (or
    full-matrix) attention gives the greedy continuation the per-row C kernel gives."""
    (on, on_logprobs), (off, off_logprobs) = greedy_with_and_without_long_chunk_path(
        tiny_model("llama"), 1200, block_tokens, 512
    )
    assert on == off
    torch.testing.assert_close(torch.tensor(on_logprobs), torch.tensor(off_logprobs), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_a_2000_token_prompt_gives_the_same_greedy_output_with_blockwise_attention_on_and_off(
    tiny_model: Callable[[str], Path],
) -> None:
    (on, on_logprobs), (off, off_logprobs) = greedy_with_and_without_long_chunk_path(
        tiny_model("qwen2-window"), 2000, 64, 1024
    )
    assert on == off
    torch.testing.assert_close(torch.tensor(on_logprobs), torch.tensor(off_logprobs), atol=1e-4, rtol=0)
