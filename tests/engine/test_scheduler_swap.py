"""Preemption by swapping, driven step by step on the pure scheduler with a given chooser: the plan names
the blocks to copy out and back, the sequence resumes where it was, and a weight update or an abort
forgets the swapped KV."""

from __future__ import annotations

import pytest

from tether.engine import EngineConfig, Scheduler, Sequence, SequenceStatus
from tether.engine.config import PreemptionMode

from .test_scheduler import chunks_of, step

SWAP_CONFIG = {
    "num_blocks": 4,
    "block_size": 4,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 16,
    "max_model_len": 16,
    "enable_prefix_caching": False,
}


def make_swapping(mode: PreemptionMode = PreemptionMode.SWAP) -> tuple[Scheduler, list[tuple[int, int, int]]]:
    """A scheduler whose chooser answers `mode` and records what it was asked."""
    asked: list[tuple[int, int, int]] = []

    def choose(seq_id: int, num_blocks: int, num_tokens: int) -> PreemptionMode:
        asked.append((seq_id, num_blocks, num_tokens))
        return mode

    config = EngineConfig(**SWAP_CONFIG, preemption_mode="swap", kv_host_tier_mib=1)  # type: ignore[arg-type]
    return Scheduler(config, choose_preemption=choose), asked


def test_a_swapped_sequence_resumes_from_its_kv_instead_of_recomputing() -> None:
    scheduler, asked = make_swapping()
    scheduler.add(Sequence(1, "first", range(8)))
    scheduler.add(Sequence(2, "second", range(100, 108)))
    step(scheduler, token=1)  # both hold two full blocks and sampled a token
    victim = scheduler.get(2)
    assert victim is not None
    held = list(victim.block_table)
    output = step(scheduler, token=1)
    assert output.preempted == [2] and asked == [(2, 2, 8)]
    assert [(s.seq_id, s.block_ids, s.num_tokens) for s in output.swap_out] == [(2, held, 8)]
    assert victim.status is SequenceStatus.SWAPPED and victim.block_table == []
    assert scheduler.num_swap_preemptions == 1 and scheduler.num_recomputed_tokens == 0
    step(scheduler, finish=[1])
    output = scheduler.schedule()
    assert [s.seq_id for s in output.swap_in] == [2] and len(output.swap_in[0].block_ids) == 2
    assert chunks_of(output) == {2: (8, 1, True)}  # only the token sampled before the swap is computed
    assert output.swap_in[0].block_ids == victim.block_table[:2]


def test_recompute_answer_drops_the_kv_and_counts_the_tokens() -> None:
    scheduler, _ = make_swapping(PreemptionMode.RECOMPUTE)
    scheduler.add(Sequence(1, "first", range(8)))
    scheduler.add(Sequence(2, "second", range(100, 108)))
    step(scheduler)
    output = step(scheduler)
    assert output.preempted == [2] and output.swap_out == []
    assert scheduler.num_recomputed_tokens == 8 and scheduler.num_swap_preemptions == 0


def test_a_weight_update_turns_swapped_sequences_into_recomputed_ones() -> None:
    scheduler, _ = make_swapping()
    scheduler.add(Sequence(1, "first", range(8)))
    scheduler.add(Sequence(2, "second", range(100, 108)))
    step(scheduler)
    step(scheduler)
    dropped = scheduler.recompute_all()
    assert {seq.seq_id for seq in dropped} == {1, 2}
    assert all(seq.status is SequenceStatus.PREEMPTED for seq in dropped)
    output = scheduler.schedule()
    assert output.swap_in == [] and chunks_of(output)[1][0] == 0


def test_an_aborted_swapped_sequence_is_forgotten() -> None:
    scheduler, _ = make_swapping()
    scheduler.add(Sequence(1, "first", range(8)))
    scheduler.add(Sequence(2, "second", range(100, 108)))
    step(scheduler)
    step(scheduler)
    assert [seq.seq_id for seq in scheduler.abort("second")] == [2]
    step(scheduler, finish=[1])
    assert not scheduler.has_unfinished() and scheduler.schedule().swap_in == []


def test_swap_without_a_chooser_is_refused() -> None:
    config = EngineConfig(**SWAP_CONFIG, preemption_mode="auto", kv_host_tier_mib=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="preemption_mode 'auto' needs a choose_preemption"):
        Scheduler(config)
