"""Scheduler: continuous batching, chunked prefill, priorities, preemption and forks, driven step by step."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from tether.engine import (
    EngineConfig,
    FinishReason,
    RequestError,
    Scheduler,
    SchedulerOutput,
    Sequence,
    SequenceStatus,
)


def make(**overrides: Any) -> Scheduler:
    values: dict[str, Any] = {
        "num_blocks": 64,
        "block_size": 4,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 16,
        "max_model_len": 64,
        **overrides,
    }
    return Scheduler(EngineConfig(**values))


def step(
    scheduler: Scheduler, token: int = 7, finish: Iterable[int] = (), max_output: int | None = None
) -> SchedulerOutput:
    """One engine step: every sampling chunk gets `token`; `finish` and sequences at `max_output` stop."""
    output = scheduler.schedule()
    sampled: dict[int, int | None] = {c.seq_id: token for c in output.chunks if c.samples}
    finished = {seq_id: FinishReason.STOP for seq_id in finish}
    for seq_id in sampled:
        seq = scheduler.get(seq_id)
        if max_output is not None and seq is not None and seq.num_output_tokens + 1 >= max_output:
            finished[seq_id] = FinishReason.STOP
    scheduler.update_from_output(output, sampled, finished)
    return output


def output_len(scheduler: Scheduler, seq_id: int) -> int:
    seq = scheduler.get(seq_id)
    assert seq is not None
    return seq.num_output_tokens


def chunks_of(output: SchedulerOutput) -> dict[int, tuple[int, int, bool]]:
    return {c.seq_id: (c.start, c.num_tokens, c.samples) for c in output.chunks}


def test_a_prompt_is_prefilled_then_decoded_one_token_per_step() -> None:
    scheduler = make()
    scheduler.add(Sequence(1, "r", range(10)))
    first = scheduler.schedule()
    (chunk,) = first.chunks
    assert (chunk.start, chunk.num_tokens, chunk.samples) == (0, 10, True)
    assert chunk.token_ids == list(range(10)) and len(chunk.block_table) == 3
    first_block = chunk.block_table[0]
    assert chunk.slot_mapping(4)[:5] == [first_block * 4 + i for i in range(4)] + [chunk.block_table[1] * 4]
    assert (chunk.end, chunk.positions) == (10, range(10))
    scheduler.update_from_output(first, {1: 42}, {})
    second = scheduler.schedule()
    assert chunks_of(second) == {1: (10, 1, True)}
    assert second.chunks[0].token_ids == [42]


def test_chunked_prefill_respects_the_token_budget_over_several_steps() -> None:
    scheduler = make(max_num_batched_tokens=8)
    scheduler.add(Sequence(1, "r", range(20)))
    assert [chunks_of(step(scheduler))[1] for _ in range(4)] == [
        (0, 8, False),
        (8, 8, False),
        (16, 4, True),
        (20, 1, True),
    ]
    seq = scheduler.get(1)
    assert seq is not None and seq.output_token_ids == [7, 7]


def test_new_requests_join_a_running_batch_between_steps() -> None:
    scheduler = make()
    scheduler.add(Sequence(1, "a", range(5)))
    step(scheduler)
    scheduler.add(Sequence(2, "b", range(100, 106)))
    assert chunks_of(step(scheduler)) == {1: (5, 1, True), 2: (0, 6, True)}
    assert chunks_of(step(scheduler)) == {1: (6, 1, True), 2: (6, 1, True)}


def test_decodes_and_a_prefill_chunk_share_the_budget() -> None:
    scheduler = make(max_num_batched_tokens=8)
    for seq_id in (1, 2):
        scheduler.add(Sequence(seq_id, str(seq_id), [seq_id] * 3))
    step(scheduler)
    scheduler.add(Sequence(3, "long", range(100, 120)))
    output = step(scheduler)
    assert chunks_of(output) == {1: (3, 1, True), 2: (3, 1, True), 3: (0, 6, False)}
    assert output.num_batched_tokens == 8


def test_finished_sequences_free_their_blocks_at_once() -> None:
    scheduler = make(enable_prefix_caching=False)
    scheduler.add(Sequence(1, "r", range(10)))
    step(scheduler)
    assert scheduler.block_manager.num_used_blocks == 3
    output = scheduler.schedule()
    done = scheduler.update_from_output(output, {1: 2}, {1: FinishReason.STOP})
    assert [seq.seq_id for seq in done] == [1]
    assert done[0].status is SequenceStatus.FINISHED and done[0].finish_reason is FinishReason.STOP
    assert done[0].output_token_ids == [7, 2] and done[0].block_table == []
    assert scheduler.block_manager.num_used_blocks == 0 and not scheduler.has_unfinished()
    assert scheduler.schedule().is_empty


def test_max_num_seqs_is_respected() -> None:
    scheduler = make(max_num_seqs=2)
    for seq_id in range(5):
        scheduler.add(Sequence(seq_id, str(seq_id), [seq_id]))
    assert set(chunks_of(step(scheduler))) == {0, 1}
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 3
    assert set(chunks_of(step(scheduler, finish=[0]))) == {0, 1}
    assert set(chunks_of(step(scheduler))) == {1, 2}


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    scheduler = make(max_num_seqs=1)
    for seq_id, priority in [(1, 0), (2, 5), (3, 2), (4, 5), (5, 0)]:
        scheduler.add(Sequence(seq_id, str(seq_id), [seq_id], priority=priority))
    order: list[int] = []
    while scheduler.has_unfinished():
        output = step(scheduler)
        order.extend(seq_id for seq_id in chunks_of(output) if seq_id not in order)
        step(scheduler, finish=[order[-1]])
    assert order == [2, 4, 3, 1, 5]


def test_out_of_blocks_preempts_the_lowest_priority_and_it_completes_later() -> None:
    # 8 blocks of 4 tokens; two sequences of 9 prompt tokens growing to 24 tokens each cannot both fit.
    scheduler = make(num_blocks=8, max_model_len=32)
    scheduler.add(Sequence(1, "low", range(9), priority=0))
    scheduler.add(Sequence(2, "high", range(100, 109), priority=1))
    preempted: list[int] = []
    finished: dict[int, list[int]] = {}
    for _ in range(100):
        output = scheduler.schedule()
        preempted.extend(output.preempted)
        sampled: dict[int, int | None] = {c.seq_id: 3 for c in output.chunks if c.samples}
        done = {i: FinishReason.STOP for i in sampled if output_len(scheduler, i) == 14}
        for seq in scheduler.update_from_output(output, sampled, done):
            finished[seq.seq_id] = seq.output_token_ids
        if not scheduler.has_unfinished():
            break
    assert preempted and set(preempted) == {1}
    assert finished == {1: [3] * 15, 2: [3] * 15}
    assert scheduler.block_manager.num_used_blocks == 0


def test_among_equal_priorities_the_latest_arrival_is_preempted() -> None:
    scheduler = make(num_blocks=4, max_model_len=16, enable_prefix_caching=False)
    scheduler.add(Sequence(1, "first", range(8)))
    scheduler.add(Sequence(2, "second", range(100, 108)))
    step(scheduler)  # both hold two full blocks; the next token of each needs a third block
    output = step(scheduler)
    assert output.preempted == [2] and set(chunks_of(output)) == {1}
    assert scheduler.num_preemptions == 1
    seq = scheduler.get(2)
    assert seq is not None and seq.status is SequenceStatus.PREEMPTED and seq.num_preemptions == 1
    assert seq.num_computed_tokens == 0 and seq.block_table == []


def test_a_sequence_preempted_after_some_output_recomputes_prompt_and_output() -> None:
    scheduler = make(num_blocks=4, max_model_len=16, enable_prefix_caching=False)
    scheduler.add(Sequence(1, "first", range(8)))
    scheduler.add(Sequence(2, "second", range(100, 108)))
    step(scheduler, token=1)
    step(scheduler, token=1)  # preempts 2, which already sampled one token
    output = step(scheduler, finish=[1])
    assert chunks_of(output)[1] == (9, 1, True)
    output = scheduler.schedule()
    assert chunks_of(output) == {2: (0, 9, True)}
    assert output.chunks[0].token_ids == [*range(100, 108), 1]


def test_a_higher_priority_arrival_preempts_a_lower_priority_running_sequence() -> None:
    scheduler = make(num_blocks=4, max_model_len=16, max_num_batched_tokens=8)
    scheduler.add(Sequence(1, "batch", range(12), priority=0))
    step(scheduler)
    step(scheduler)
    scheduler.add(Sequence(2, "urgent", range(100, 112), priority=3))
    output = step(scheduler)
    # The preempted decode gives its token back to the budget: the arrival gets all 8.
    assert output.preempted == [1] and chunks_of(output) == {2: (0, 8, False)}


def test_a_preempted_sequence_leaves_no_block_copy_behind() -> None:
    scheduler = make(num_blocks=4, max_model_len=16)
    scheduler.add(Sequence(1, "batch", range(6), priority=0))
    output = scheduler.schedule()
    scheduler.fork(1, 2)
    scheduler.update_from_output(output, {1: 10, 2: 20}, {})
    scheduler.add(Sequence(3, "urgent", range(100, 112), priority=3))
    output = scheduler.schedule()  # the parent's decode copied the shared block, then both were preempted
    assert output.preempted == [2, 1] and chunks_of(output) == {3: (0, 12, True)}
    assert output.copies == []


def test_an_equal_priority_arrival_waits_instead_of_preempting() -> None:
    scheduler = make(num_blocks=4, max_model_len=16)
    scheduler.add(Sequence(1, "batch", range(12), priority=1))
    step(scheduler)
    scheduler.add(Sequence(2, "same", range(100, 108), priority=1))
    output = step(scheduler)
    assert output.preempted == [] and set(chunks_of(output)) == {1}


def test_a_higher_priority_arrival_takes_a_seat_from_a_lower_priority_one() -> None:
    scheduler = make(max_num_seqs=1)
    scheduler.add(Sequence(1, "batch", range(4), priority=0))
    step(scheduler)
    scheduler.add(Sequence(2, "urgent", range(100, 104), priority=1))
    output = step(scheduler)
    assert output.preempted == [1] and set(chunks_of(output)) == {2}


def test_a_repeated_prompt_is_served_from_the_prefix_cache() -> None:
    scheduler = make()
    scheduler.add(Sequence(1, "a", range(18)))
    step(scheduler, finish=[1])
    scheduler.add(Sequence(2, "b", range(18)))
    output = scheduler.schedule()
    assert chunks_of(output) == {2: (16, 2, True)}
    seq = scheduler.get(2)
    assert seq is not None and seq.num_cached_tokens == 16


def test_requests_arriving_together_compute_a_shared_prefix_once() -> None:
    scheduler = make(max_num_batched_tokens=64)
    system = list(range(100, 112))  # three full blocks of 4 shared by every prompt
    for seq_id in (1, 2, 3):
        scheduler.add(Sequence(seq_id, f"r{seq_id}", [*system, seq_id, seq_id + 50]))
    scheduler.add(Sequence(4, "other", range(14)))  # nothing in common: not held back
    first = scheduler.schedule()
    assert chunks_of(first) == {1: (0, 14, True), 4: (0, 14, True)}
    scheduler.update_from_output(first, {1: 7, 4: 7}, {})
    second = scheduler.schedule()
    assert {seq_id: chunks_of(second)[seq_id] for seq_id in (2, 3)} == {2: (12, 2, True), 3: (12, 2, True)}
    assert [scheduler.get(seq_id).num_cached_tokens for seq_id in (2, 3)] == [12, 12]  # type: ignore[union-attr]


def test_a_held_back_request_is_admitted_once_the_prefill_it_waited_for_is_preempted() -> None:
    scheduler = make(max_num_batched_tokens=12, max_num_seqs=4, num_blocks=6, max_model_len=24)
    scheduler.add(Sequence(1, "low", range(20)))
    step(scheduler)  # 12 of 20 prompt tokens: blocks 0-2 are cached now
    scheduler.add(Sequence(2, "same", range(20), priority=1))
    output = scheduler.schedule()  # 1 computes blocks 3-4; 2 would compute block 3 itself: it waits
    assert chunks_of(output) == {1: (12, 8, True)}
    scheduler.add(Sequence(3, "urgent", range(200, 220), priority=2))
    scheduler.update_from_output(output, {1: 7}, {})
    outcome = scheduler.schedule()  # 3 preempts 1: nothing computes 2's blocks any more
    assert 3 in chunks_of(outcome) and outcome.preempted == [1]
    scheduler.update_from_output(outcome, {}, {3: FinishReason.STOP})
    start, num_tokens, samples = chunks_of(scheduler.schedule())[2]  # admitted ahead of the lower-priority 1
    assert start + num_tokens == 20 and samples  # what 3 left of the cache is reused, the rest computed


def test_a_long_cached_prompt_takes_only_budget_for_its_uncached_tokens() -> None:
    scheduler = make(max_num_batched_tokens=8)
    scheduler.add(Sequence(1, "a", range(30)))
    for _ in range(4):
        step(scheduler)
    scheduler.add(Sequence(2, "b", [*range(30), 99]))
    assert chunks_of(scheduler.schedule())[2] == (28, 3, True)


def test_abort_frees_blocks_of_running_and_waiting_sequences() -> None:
    scheduler = make(max_num_seqs=1, enable_prefix_caching=False)
    scheduler.add(Sequence(1, "run", range(10)))
    scheduler.add(Sequence(2, "wait", range(10)))
    output = scheduler.schedule()
    aborted = scheduler.abort("run") + scheduler.abort("wait")
    assert [seq.finish_reason for seq in aborted] == [FinishReason.ABORT] * 2
    assert scheduler.block_manager.num_used_blocks == 0 and not scheduler.has_unfinished()
    assert scheduler.update_from_output(output, {1: 5}, {}) == []  # results of aborted sequences are dropped
    assert scheduler.abort("unknown") == []


def test_fork_shares_the_prompt_and_each_sample_decodes_its_own_token() -> None:
    scheduler = make()
    scheduler.add(Sequence(1, "r", range(6)))
    output = scheduler.schedule()
    children = [scheduler.fork(1, child_id) for child_id in (2, 3)]
    parent = scheduler.get(1)
    assert parent is not None
    assert all(child.block_table == parent.block_table for child in children)
    assert all(scheduler.block_manager.ref_count(b) == 3 for b in parent.block_table)
    scheduler.update_from_output(output, {1: 10, 2: 20, 3: 30}, {})
    output = scheduler.schedule()
    assert chunks_of(output) == {1: (6, 1, True), 2: (6, 1, True), 3: (6, 1, True)}
    assert {c.seq_id: c.token_ids for c in output.chunks} == {1: [10], 2: [20], 3: [30]}
    assert len(output.copies) == 2  # two of the three owners of the partial block copy it
    assert scheduler.block_manager.num_used_blocks == 4


def test_a_fork_without_a_free_seat_waits() -> None:
    scheduler = make(max_num_seqs=1)
    scheduler.add(Sequence(1, "r", range(6)))
    output = scheduler.schedule()
    child = scheduler.fork(1, 2)
    assert child.status is SequenceStatus.WAITING and child.block_table == []
    scheduler.update_from_output(output, {1: 10, 2: 20}, {1: FinishReason.STOP})
    assert chunks_of(scheduler.schedule()) == {2: (4, 3, True)}  # the prompt's full block from the cache


def test_fork_of_a_sequence_that_does_not_sample_is_refused() -> None:
    scheduler = make(max_num_batched_tokens=8)
    scheduler.add(Sequence(1, "r", range(12)))
    scheduler.schedule()
    with pytest.raises(ValueError, match="does not sample"):
        scheduler.fork(1, 2)


def test_a_token_for_a_sequence_that_did_not_sample_is_refused() -> None:
    scheduler = make(max_num_batched_tokens=8)
    scheduler.add(Sequence(1, "r", range(12)))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="did not sample"):
        scheduler.update_from_output(output, {1: 3}, {})


def test_a_sequence_reaching_max_model_len_is_finished_for_length() -> None:
    scheduler = make(max_model_len=12)
    scheduler.add(Sequence(1, "r", range(10)))
    step(scheduler)
    output = scheduler.schedule()
    (done,) = scheduler.update_from_output(output, {1: 7}, {})
    assert done.finish_reason is FinishReason.LENGTH and done.num_tokens == 12


@pytest.mark.parametrize(
    ("prompt", "match"),
    [([], "prompt of 0 tokens: expected 1 to 63"), (range(64), "prompt of 64 tokens: expected 1 to 63")],
)
def test_unservable_prompts_are_refused(prompt: Iterable[int], match: str) -> None:
    with pytest.raises(RequestError, match=match):
        make().add(Sequence(1, "r", prompt))


def test_a_duplicate_sequence_id_is_refused() -> None:
    scheduler = make()
    scheduler.add(Sequence(1, "r", [1]))
    with pytest.raises(RequestError, match="sequence id 1 is already queued"):
        scheduler.add(Sequence(1, "other", [1]))


def test_recompute_all_drops_every_running_kv_and_recomputes_prompt_and_output() -> None:
    scheduler = make(max_num_batched_tokens=64)
    scheduler.add(Sequence(1, "a", range(10)))
    scheduler.add(Sequence(2, "b", range(20, 26)))
    step(scheduler)
    step(scheduler)
    free_before = scheduler.block_manager.num_free_blocks
    scheduler.block_manager.invalidate_prefix_cache()  # as the engine does on new weights
    dropped = scheduler.recompute_all()
    assert [seq.seq_id for seq in dropped] == [1, 2]
    assert all(seq.status is SequenceStatus.PREEMPTED and seq.num_computed_tokens == 0 for seq in dropped)
    assert not scheduler.running and scheduler.block_manager.num_free_blocks > free_before
    # Both come back computing all their tokens (prompt and the two outputs) from position 0.
    assert chunks_of(step(scheduler)) == {1: (0, 12, True), 2: (0, 8, True)}
    assert output_len(scheduler, 1) == output_len(scheduler, 2) == 3


def test_check_refuses_what_add_would_without_queueing() -> None:
    scheduler = make()
    with pytest.raises(RequestError, match="prompt of 64 tokens"):
        scheduler.check(Sequence(1, "long", range(64)))
    scheduler.check(Sequence(2, "ok", range(5)))
    assert not scheduler.has_unfinished()
