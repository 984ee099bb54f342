"""Random workloads against the scheduler and block manager, with invariants checked after every step.

A fake model runner stands in for the KV cache: each slot records which token prefix (and which weights
version) its KV was computed from, so a chunk that would attend to a wrong or stale slot (a bad prefix
hit, a missing copy-on-write, a block reused while still referenced) fails the test.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tests.engine.fake_kv import apply_block_copies
from tether.engine import EngineConfig, FinishReason, Scheduler, SchedulerOutput, Sequence, SequenceStatus

KvValue = tuple[int, tuple[int, ...]]  # (weights version, tokens up to and including the position)


def check_blocks(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    live = scheduler.running + scheduler.waiting
    owners: Counter[int] = Counter(b for seq in live for b in seq.block_table)
    for block_id in range(bm.num_blocks):
        assert bm.ref_count(block_id) == owners[block_id], f"block {block_id}"
    assert bm.num_used_blocks == len(owners)
    assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
    requests: dict[int, set[str]] = {}
    partial: set[int] = set()  # blocks some owner will still write to
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table)
        for index, block_id in enumerate(seq.block_table):
            requests.setdefault(block_id, set()).add(seq.request_id)
            if (index + 1) * bm.block_size > seq.num_computed_tokens:
                partial.add(block_id)
    for block_id, users in requests.items():
        # Across requests only full, computed blocks are shared (through the prefix cache).
        assert len(users) == 1 or block_id not in partial, f"block {block_id} shared by {users}"
    for seq in scheduler.waiting:
        assert seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    for seq in scheduler.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
        assert seq.num_tokens <= scheduler.config.max_model_len


def check_output(scheduler: Scheduler, output: SchedulerOutput) -> None:
    config = scheduler.config
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert len(scheduler.running) <= config.max_num_seqs
    ids = [chunk.seq_id for chunk in output.chunks]
    assert len(ids) == len(set(ids))
    assert not set(ids) & set(output.preempted)
    for chunk in output.chunks:
        seq = scheduler.get(chunk.seq_id)
        assert seq is not None and seq.status is SequenceStatus.RUNNING
        assert chunk.num_tokens >= 1
        assert seq.num_computed_tokens == chunk.start + chunk.num_tokens
        assert chunk.samples == (chunk.start + chunk.num_tokens == seq.num_tokens)
        assert chunk.token_ids == seq.token_ids[chunk.start : chunk.start + chunk.num_tokens]
        assert chunk.block_table == seq.block_table
        assert chunk.slot_mapping(config.block_size) == scheduler.block_manager.slot_mapping(
            seq, chunk.start, chunk.num_tokens
        )


def run_model(
    scheduler: Scheduler, output: SchedulerOutput, kv: dict[int, KvValue], version: int, since: dict[int, int]
) -> None:
    """Check every chunk reads KV of its own prefix, computed no earlier than its admission; write KV."""
    size = scheduler.config.block_size
    apply_block_copies(kv, output.copies, size)
    for chunk in output.chunks:
        seq = scheduler.get(chunk.seq_id)
        assert seq is not None
        for position in range(chunk.start + chunk.num_tokens):
            slot = chunk.block_table[position // size] * size + position % size
            prefix = tuple(seq.token_ids[: position + 1])
            if position < chunk.start:
                seen_version, seen_prefix = kv[slot]
                assert seen_prefix == prefix, f"seq {seq.seq_id} position {position} reads foreign KV"
                assert seen_version >= since[seq.seq_id], f"seq {seq.seq_id} reads stale KV"
            else:
                kv[slot] = (version, prefix)


@pytest.mark.parametrize("seed", range(40))
def test_random_workload_keeps_invariants_and_completes(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    max_model_len = rng.choice([16, 24, 40])
    config = EngineConfig(
        num_blocks=-(-max_model_len // block_size) + rng.choice([0, 1, 3, 8, 20]),
        block_size=block_size,
        max_num_seqs=rng.choice([1, 2, 4, 8]),
        max_num_batched_tokens=rng.choice([8, 13, 32]),
        max_model_len=max_model_len,
        enable_prefix_caching=rng.random() < 0.8,
    )
    scheduler = Scheduler(config)
    bases = [[rng.randrange(50) for _ in range(max_model_len)] for _ in range(3)]
    kv: dict[int, KvValue] = {}
    since: dict[int, int] = {}  # seq_id -> weights version when it was last (re)admitted
    targets: dict[int, int] = {}  # seq_id -> output tokens it stops at
    expected_done: set[int] = set()
    done: dict[int, FinishReason] = {}
    version = 0
    next_id = 0
    for step in range(5000):
        arriving = step < 60
        for _ in range(rng.choice([0, 0, 1, 2]) if arriving else 0):
            length = rng.randrange(1, max_model_len - 1)
            prompt = rng.choice(bases)[: rng.randrange(0, length + 1)]
            prompt += [rng.randrange(50) for _ in range(length - len(prompt))]
            scheduler.add(Sequence(next_id, f"r{next_id}", prompt, priority=rng.choice([0, 0, 1, 2])))
            targets[next_id] = rng.randrange(1, 12)
            expected_done.add(next_id)
            next_id += 1
        if arriving and scheduler.has_unfinished() and rng.random() < 0.03:
            victim = rng.choice(scheduler.running + scheduler.waiting)
            for seq in scheduler.abort(victim.request_id):
                done[seq.seq_id] = FinishReason.ABORT
        if arriving and rng.random() < 0.02:
            scheduler.block_manager.invalidate_prefix_cache()
            version += 1

        running_before = {seq.seq_id for seq in scheduler.running}
        output = scheduler.schedule()
        check_output(scheduler, output)
        for chunk in output.chunks:
            if chunk.seq_id not in running_before:
                since[chunk.seq_id] = version
        run_model(scheduler, output, kv, version, since)

        sampled: dict[int, int | None] = {}
        finished: dict[int, FinishReason] = {}
        for chunk in output.chunks:
            if not chunk.samples:
                continue
            parent = scheduler.get(chunk.seq_id)
            assert parent is not None
            if arriving and rng.random() < 0.1:  # an extra sample of this request
                child = scheduler.fork(chunk.seq_id, next_id)
                since[next_id] = since[chunk.seq_id]
                targets[next_id] = targets[chunk.seq_id]
                expected_done.add(next_id)
                sampled[next_id] = rng.randrange(50)
                next_id += 1
                if child.num_output_tokens + 1 >= targets[child.seq_id]:
                    finished[child.seq_id] = FinishReason.STOP
            sampled[chunk.seq_id] = rng.randrange(50)
            if parent.num_output_tokens + 1 >= targets[chunk.seq_id]:
                finished[chunk.seq_id] = FinishReason.STOP
        for seq in scheduler.update_from_output(output, sampled, finished):
            assert seq.finish_reason is not None
            done[seq.seq_id] = seq.finish_reason
        check_blocks(scheduler)
        if not arriving and not scheduler.has_unfinished():
            break
    assert not scheduler.has_unfinished(), f"stuck: {scheduler.running + scheduler.waiting}"
    assert set(done) == expected_done
    assert scheduler.block_manager.num_used_blocks == 0
    assert set(done.values()) <= {FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT}
