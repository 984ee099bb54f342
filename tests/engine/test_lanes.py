"""Data-parallel lanes: a step split over threads gives the logits of the whole step run as one."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tether.engine.model_runner import MIN_LANE_TOKENS, ModelRunner, SequenceChunk, split_lanes
from tether.models import load

BLOCK = 4


def chunk(tokens: int, start: int = 0) -> SequenceChunk:
    return SequenceChunk([1] * tokens, start, list(range(-(-(start + tokens) // BLOCK))))


def sizes(groups: list[list[SequenceChunk]]) -> list[int]:
    return [sum(len(c.token_ids) for c in group) for group in groups]


def test_decode_rows_split_evenly_and_in_order() -> None:
    chunks = [chunk(1, start=i) for i in range(64)]
    groups = split_lanes(chunks, 2)
    assert sizes(groups) == [32, 32]
    assert [c for group in groups for c in group] == chunks


def test_a_long_prefill_stays_whole_and_the_decodes_share_the_other_lane() -> None:
    chunks = [chunk(1, start=5), chunk(200), *(chunk(1, start=9) for _ in range(30))]
    groups = split_lanes(chunks, 2)
    assert len(groups) == 2
    assert [c for group in groups for c in group] == chunks
    assert any(len(c.token_ids) == 200 for c in groups[0])


@pytest.mark.parametrize("tokens", [1, MIN_LANE_TOKENS, 2 * MIN_LANE_TOKENS - 1])
def test_a_step_too_small_to_share_is_one_group(tokens: int) -> None:
    assert len(split_lanes([chunk(1, start=i) for i in range(tokens)], 4)) == 1


def test_a_minimum_per_lane_keeps_small_steps_whole() -> None:
    decodes = [chunk(1, start=i) for i in range(20)]
    assert len(split_lanes(decodes, 2, min_tokens=16)) == 1
    assert sizes(split_lanes(decodes + decodes, 2, min_tokens=16)) == [20, 20]


def test_never_more_groups_than_lanes_or_chunks() -> None:
    assert len(split_lanes([chunk(100), chunk(100)], 8)) == 2
    assert len(split_lanes([chunk(1, start=i) for i in range(64)], 3)) == 3


def test_bad_lane_counts_are_refused(tiny_model: Callable[[str], Path]) -> None:
    model, _, _ = load(tiny_model("llama"))
    runner = ModelRunner(model, num_blocks=8, block_size=BLOCK)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="lanes must be an integer"):
            runner.set_lanes(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_lanes_give_the_logits_of_one_forward(architecture: str, tiny_model: Callable[[str], Path]) -> None:
    model, _, config = load(tiny_model(architecture))
    rng = random.Random(0)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(rng.randint(3, 20))] for _ in range(12)]
    runners = [ModelRunner(model, num_blocks=128, block_size=BLOCK, lanes=lanes) for lanes in (1, 2, 3)]
    tables = [list(range(i * 10, i * 10 + 10)) for i in range(len(prompts))]
    steps: list[list[SequenceChunk]] = [
        [SequenceChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)],  # prefills of mixed lengths
    ]
    lengths = [len(p) for p in prompts]
    for step in range(6):  # decodes, with one sequence prefilling a second prompt part on the way
        steps.append(
            [
                SequenceChunk([rng.randrange(config.vocab_size)] * (5 if i == 3 and step == 2 else 1), n, t)
                for i, (n, t) in enumerate(zip(lengths, tables, strict=True))
            ]
        )
        lengths = [n + len(c.token_ids) for n, c in zip(lengths, steps[-1], strict=True)]
    threads = torch.get_num_threads()
    try:
        for chunks in steps:
            one, *split = (runner.step(chunks) for runner in runners)
            assert one.shape == (len(chunks), config.vocab_size)
            for logits in split:
                torch.testing.assert_close(logits, one, atol=1e-5, rtol=0)
    finally:
        for runner in runners:
            runner.close()
    assert torch.get_num_threads() == threads  # a lane's share is given back after every step
