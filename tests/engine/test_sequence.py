"""Sequence: token bookkeeping and forks."""

from __future__ import annotations

from tether.engine import Sequence, SequenceStatus


def test_tokens_split_into_prompt_and_output() -> None:
    seq = Sequence(1, "r", [5, 6, 7], priority=2)
    seq.append_token(8)
    assert seq.all_token_ids == [5, 6, 7, 8]
    assert seq.prompt_token_ids == [5, 6, 7]
    assert seq.output_token_ids == [8]
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (4, 3, 1)
    assert seq.last_token_id == 8
    assert seq.status is SequenceStatus.WAITING and not seq.is_finished


def test_prefill_lasts_until_every_prompt_token_is_computed() -> None:
    seq = Sequence(1, "r", range(10))
    seq.num_computed_tokens = 9
    assert seq.is_prefill and seq.num_uncomputed_tokens == 1
    seq.num_computed_tokens = 10
    seq.append_token(3)
    assert not seq.is_prefill and seq.num_uncomputed_tokens == 1


def test_fork_copies_tokens_but_not_blocks() -> None:
    parent = Sequence(1, "r", [1, 2, 3], priority=4)
    parent.append_token(9)
    parent.num_computed_tokens = 4
    parent.block_table = [3]
    child = parent.fork(2)
    child.append_token(10)
    assert (child.seq_id, child.request_id, child.priority) == (2, "r", 4)
    assert child.prompt_token_ids == [1, 2, 3] and child.output_token_ids == [9, 10]
    assert parent.all_token_ids == [1, 2, 3, 9]
    assert child.num_computed_tokens == 4 and child.block_table == []
