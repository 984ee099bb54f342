"""Speculative decoding: exact greedy output, target-distributed sampling, KV rollback and prefix-cache
hygiene under rejected drafts, exact finish conditions when several tokens land in one step, config errors."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.engine.fake_kv import apply_block_copies
from tests.engine.test_scheduler_invariants import check_blocks
from tether.engine import EngineConfig, FinishReason, Scheduler, SchedulerOutput, Sequence
from tether.engine.block_manager import BlockManager
from tether.engine.llm_engine import LLMEngine
from tether.engine.model_runner import ModelRunner, SequenceChunk
from tether.engine.sampling import SamplingParams, probabilities
from tether.engine.speculative import (
    Draft,
    SpeculativeConfig,
    find_ngram_draft,
    verify,
)
from tether.errors import ConfigError
from tether.models import load
from tether.testing import make_tiny_model

BLOCK = 4
# Repeated patterns, so that n-gram lookup finds drafts the model sometimes agrees with.
PROMPTS = [[5, 9, 13, 7, 5, 9, 13, 7, 5, 9, 13, 7, 5, 9], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [8, 2, 8, 2, 8]]
GREEDY = SamplingParams(max_tokens=30, temperature=0)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # Thousands of tiny tensor ops: thread hand-offs would dominate, worse on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen3", seed=0)


@pytest.fixture(scope="module")
def other_tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("other"), "qwen3", seed=1)


def runner(path: Path, num_blocks: int = 64) -> ModelRunner:
    model, _, _ = load(path)
    return ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK)


def make_engine(
    path: Path,
    speculative: SpeculativeConfig | None = None,
    num_blocks: int = 64,
    max_tokens_per_step: int = 32,
) -> LLMEngine:
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_num_seqs=8,
        max_num_batched_tokens=max_tokens_per_step,
        max_model_len=64,
    )
    return LLMEngine(runner(path, num_blocks), config, speculative=speculative)


def token_ids(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [output.completions[0].token_ids for output in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def baseline(tiny_path: Path) -> list[list[int]]:
    return token_ids(make_engine(tiny_path), PROMPTS, GREEDY)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_output_is_identical_with_ngram_speculation(
    tiny_path: Path, baseline: list[list[int]], k: int
) -> None:
    engine = make_engine(tiny_path, SpeculativeConfig(num_speculative_tokens=k))
    assert token_ids(engine, PROMPTS, GREEDY) == baseline
    stats = engine.spec_stats
    assert stats.num_drafted_tokens > 0 and stats.num_accepted_tokens > 0
    assert 0 < stats.acceptance_rate <= 1
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("draft_is_target", [True, False])
def test_greedy_output_is_identical_with_draft_model_speculation(
    tiny_path: Path, other_tiny_path: Path, baseline: list[list[int]], draft_is_target: bool
) -> None:
    draft = runner(tiny_path if draft_is_target else other_tiny_path)
    spec = SpeculativeConfig(mode="draft", num_speculative_tokens=3, draft_runner=draft)
    engine = make_engine(tiny_path, spec)
    assert token_ids(engine, PROMPTS, GREEDY) == baseline
    assert engine.spec_stats.num_drafted_tokens > 0
    if draft_is_target:  # the same weights always agree: every step emits k + 1 tokens
        assert engine.spec_stats.acceptance_rate == 1.0
    else:
        assert engine.spec_stats.acceptance_rate < 1.0


def empirical(draws: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(draws), minlength=vocab).double() / len(draws)


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


@pytest.mark.parametrize("draft_kind", ["ngram", "model"])
@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=4)]
)
def test_rejection_sampling_follows_the_target_distribution(draft_kind: str, params: SamplingParams) -> None:
    vocab, draws = 6, 6000
    target_logits = torch.tensor([[1.5, 0.2, -0.5, 1.0, 0.0, -1.0], [0.0, 1.0, 0.5, -0.5, 2.0, 0.1]])
    draft_q = torch.softmax(torch.tensor([-1.0, 2.0, 0.5, 0.0, 1.0, 0.3]), dim=-1)
    p = probabilities(target_logits, params)[0]
    q = draft_q if draft_kind == "model" else torch.nn.functional.one_hot(torch.tensor(1), vocab).float()
    # Non-vacuous: drafts alone would fail the tolerance by far.
    assert total_variation(q, p) > 0.2
    generator = torch.Generator().manual_seed(0)
    first, accepted = [], 0
    for _ in range(draws):
        x = int(torch.multinomial(q, 1, generator=generator))
        draft = Draft([x], q[None] if draft_kind == "model" else None)
        verdict = verify(target_logits, draft, params, generator)
        first.append(verdict.token_ids[0])
        accepted += verdict.num_accepted
        expected = torch.log_softmax(target_logits / params.temperature, dim=-1)
        assert verdict.logprobs[0] == pytest.approx(float(expected[0, verdict.token_ids[0]]), abs=1e-5)
    assert total_variation(empirical(first, vocab), p) < 0.03
    assert 0 < accepted < draws


@pytest.mark.parametrize("draft_is_target", [True, False])
def test_sampled_speculation_records_the_targets_logprobs(
    tiny_path: Path, other_tiny_path: Path, draft_is_target: bool
) -> None:
    draft = runner(tiny_path if draft_is_target else other_tiny_path)
    spec = SpeculativeConfig(mode="draft", num_speculative_tokens=4, draft_runner=draft)
    engine = make_engine(tiny_path, spec)
    params = SamplingParams(max_tokens=20, temperature=0.7, seed=3)
    outputs = engine.generate(PROMPTS, params)
    assert engine.spec_stats.num_drafted_tokens > 0
    if draft_is_target:
        assert engine.spec_stats.num_accepted_tokens > 0
    check = runner(tiny_path, num_blocks=32)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        completion = output.completions[0]
        tokens = prompt + completion.token_ids
        chunk = SequenceChunk(tokens, 0, list(range(-(-len(tokens) // BLOCK))), all_logits=True)
        logits = check.step([chunk]) / params.temperature
        logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        expected = logprobs.gather(1, torch.tensor(completion.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


def test_max_tokens_is_exact_when_several_tokens_are_accepted(
    tiny_path: Path, baseline: list[list[int]]
) -> None:
    spec = SpeculativeConfig(mode="draft", num_speculative_tokens=4, draft_runner=runner(tiny_path))
    engine = make_engine(tiny_path, spec)
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=7, temperature=0))
    for output, expected in zip(outputs, baseline, strict=True):
        assert output.completions[0].token_ids == expected[:7]
        assert len(output.completions[0].logprobs) == 7
        assert output.completions[0].finish_reason is FinishReason.LENGTH


def test_stop_token_truncates_the_accepted_tokens(tiny_path: Path, baseline: list[list[int]]) -> None:
    expected = baseline[0]
    stop = expected[5]
    cut = expected.index(stop) + 1
    spec = SpeculativeConfig(mode="draft", num_speculative_tokens=4, draft_runner=runner(tiny_path))
    engine = make_engine(tiny_path, spec)
    params = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(stop,))
    (output,) = engine.generate([PROMPTS[0]], params)
    assert output.completions[0].token_ids == expected[:cut]
    assert output.completions[0].finish_reason is FinishReason.STOP
    assert engine.block_manager.num_used_blocks == 0


def test_max_model_len_is_exact_with_speculation(tiny_path: Path, baseline: list[list[int]]) -> None:
    spec = SpeculativeConfig(mode="draft", num_speculative_tokens=5, draft_runner=runner(tiny_path))
    engine = make_engine(tiny_path, spec)
    prompt = PROMPTS[0]
    (output,) = engine.generate([prompt], SamplingParams(max_tokens=100, temperature=0))
    assert len(prompt) + len(output.completions[0].token_ids) == 64
    assert output.completions[0].token_ids[:30] == baseline[0]


def test_prefix_cache_serves_the_same_tokens_after_speculation(
    tiny_path: Path, baseline: list[list[int]]
) -> None:
    engine = make_engine(tiny_path, SpeculativeConfig(num_speculative_tokens=4))
    token_ids(engine, PROMPTS, GREEDY)
    # Prompts extending the earlier outputs hit blocks computed during speculation.
    extended = [prompt + output[:20] for prompt, output in zip(PROMPTS, baseline, strict=True)]
    again = engine.generate(extended, SamplingParams(max_tokens=10, temperature=0))
    assert any(output.num_cached_tokens > 0 for output in again)
    assert [o.completions[0].token_ids for o in again] == [b[20:30] for b in baseline]


def test_trim_releases_blocks_past_the_kept_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence(0, "r", list(range(6)))
    bm.allocate(seq, 13)
    seq.num_computed_tokens = 13
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    seq.num_computed_tokens = 8
    bm.trim(seq, 8)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    seq.num_computed_tokens = 5
    bm.trim(seq, 5)
    assert len(seq.block_table) == 2  # position 4 still lives in the second block
    bm.free(seq)
    assert bm.num_free_blocks == 8


def decode(scheduler: Scheduler, seq: Sequence) -> None:
    """Prefill `seq` and sample one token, so that it decodes from the next step on."""
    output = scheduler.schedule()
    scheduler.update_from_output(output, {seq.seq_id: 99}, {})


def test_rejected_draft_kv_never_enters_the_prefix_cache() -> None:
    config = EngineConfig(
        num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32
    )
    scheduler = Scheduler(config)
    seq = Sequence(0, "a", [1, 2, 3, 4, 5, 6])
    scheduler.add(seq)
    decode(scheduler, seq)  # tokens 1..6, 99: position 6 holds 99 and is not computed yet
    output = scheduler.schedule({0: [7, 8, 9]})
    (chunk,) = output.chunks
    assert chunk.token_ids == [99, 7, 8, 9] and chunk.draft_token_ids == (7, 8, 9)
    assert seq.num_computed_tokens == 10 and len(seq.block_table) == 3
    scheduler.update_from_output(output, {0: [50]}, {})  # the first draft (7, position 7) is rejected
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 99, 50]
    assert seq.num_computed_tokens == 7 and len(seq.block_table) == 2
    check_blocks(scheduler)
    bm = scheduler.block_manager
    assert bm.stats().num_cached_blocks == 1  # the second block holds the rejected 7 at position 7
    probe = Sequence(1, "b", [1, 2, 3, 4, 5, 6, 99, 7, 8])
    assert len(bm.find_cached_prefix(probe)) == 1
    output = scheduler.schedule({0: [51, 52]})
    scheduler.update_from_output(output, {0: [51, 52, 53]}, {})  # all accepted, plus the target's token
    assert seq.token_ids[-4:] == [50, 51, 52, 53] and seq.num_computed_tokens == 10
    check_blocks(scheduler)
    probe = Sequence(2, "c", [1, 2, 3, 4, 5, 6, 99, 50, 51, 52])
    assert len(bm.find_cached_prefix(probe)) == 2


def test_drafts_never_preempt_and_respect_the_token_budget() -> None:
    config = EngineConfig(
        num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16
    )
    scheduler = Scheduler(config)
    for i in range(2):
        scheduler.add(Sequence(i, f"r{i}", [1, 2, 3]))
    output = scheduler.schedule()
    scheduler.update_from_output(output, {0: 10, 1: 10}, {})
    output = scheduler.schedule({0: [1, 2, 3, 4, 5, 6, 7], 1: [1, 2, 3]})
    assert output.num_batched_tokens <= 8 and not output.preempted
    first, second = output.chunks
    # The first keeps one token of budget for the second; the second's drafts would need a fifth block.
    assert (first.seq_id, first.draft_token_ids) == (0, (1, 2, 3, 4, 5, 6))
    assert (second.seq_id, second.draft_token_ids, second.num_tokens) == (1, (), 1)


def run_fake_model(scheduler: Scheduler, output: SchedulerOutput, kv: dict[int, tuple[int, ...]]) -> None:
    """Check every chunk reads KV of its own true prefix; write KV keyed by the tokens it was fed."""
    size = scheduler.config.block_size
    apply_block_copies(kv, output.copies, size)
    for chunk in output.chunks:
        seq = scheduler.get(chunk.seq_id)
        assert seq is not None
        fed = seq.token_ids[: chunk.start] + chunk.token_ids
        for position in range(chunk.end):
            slot = chunk.block_table[position // size] * size + position % size
            if position < chunk.start:
                assert kv[slot] == tuple(seq.token_ids[: position + 1]), f"seq {seq.seq_id} reads wrong KV"
            else:
                kv[slot] = tuple(fed[: position + 1])


@pytest.mark.parametrize("seed", range(20))
def test_random_speculative_workload_keeps_kv_and_blocks_consistent(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    config = EngineConfig(
        num_blocks=-(-32 // block_size) + rng.choice([0, 2, 8]),
        block_size=block_size,
        max_num_seqs=rng.choice([1, 2, 4]),
        max_num_batched_tokens=rng.choice([4, 9, 16]),
        max_model_len=32,
    )
    scheduler = Scheduler(config)
    base = [rng.randrange(8) for _ in range(32)]
    kv: dict[int, tuple[int, ...]] = {}
    targets: dict[int, int] = {}
    for i in range(12):
        length = rng.randrange(1, 20)
        shared = base[: rng.randrange(length + 1)]  # shared prefixes exercise the prefix cache
        scheduler.add(Sequence(i, f"r{i}", shared + [rng.randrange(8) for _ in range(length - len(shared))]))
        targets[i] = rng.randrange(1, 14)
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        drafts = {
            seq.seq_id: [rng.randrange(8) for _ in range(rng.randrange(0, 5))] for seq in scheduler.running
        }
        output = scheduler.schedule(drafts)
        run_fake_model(scheduler, output, kv)
        sampled: dict[int, int | list[int] | None] = {}
        finished: dict[int, FinishReason] = {}
        for chunk in output.chunks:
            if not chunk.samples:
                continue
            seq = scheduler.get(chunk.seq_id)
            assert seq is not None
            draft = list(chunk.draft_token_ids)
            accepted = rng.randrange(len(draft) + 1)
            emitted = [*draft[:accepted], rng.randrange(8)]
            room = targets[seq.seq_id] - seq.num_output_tokens
            sampled[seq.seq_id] = emitted[:room]
            if len(emitted) >= room:
                finished[seq.seq_id] = FinishReason.STOP
        scheduler.update_from_output(output, sampled, finished)
        check_blocks(scheduler)
        for seq in scheduler.running:
            assert seq.num_computed_tokens <= seq.num_tokens - 1 or seq.is_prefill
    assert not scheduler.has_unfinished()
    assert scheduler.block_manager.num_used_blocks == 0


def test_ngram_lookup_copies_what_followed_the_latest_match() -> None:
    assert find_ngram_draft([1, 2, 3, 9, 1, 2, 3, 7, 1, 2], 3, 1, 3) == [3, 7, 1]
    assert find_ngram_draft([1, 2, 3, 4], 2, 1, 3) == []
    assert find_ngram_draft([5, 5], 4, 1, 2) == [5]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "medusa"}, "mode = 'medusa'"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens = 0"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens = True"),
        ({"ngram_min": 3, "ngram_max": 2}, "ngram_min = 3"),
        ({"ngram_max": 0}, "ngram_max = 0"),
        ({"mode": "draft"}, "draft_runner = None"),
        ({"mode": "draft", "draft_runner": "small.bin"}, "draft_runner = 'small.bin'"),
    ],
)
def test_bad_config_values_give_clear_errors(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        SpeculativeConfig(**options)  # type: ignore[arg-type]
