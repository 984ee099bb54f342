"""Samples and micro-batch planning: prompts grouped into shared rows, large groups split by sample count
and token budget, rows placed longest first."""

from __future__ import annotations

from tether.rl.samples import Sample, plan_micro_batches


def test_micro_batch_plan_groups_prompts_splits_large_groups_and_puts_long_rows_first() -> None:
    samples = [
        Sample([1, 2, 3], 2, [-1.0], 1.0),  # prompt A
        Sample([5, 6, 7, 8, 9, 9], 2, [-1.0] * 4, 1.0),  # prompt B
        Sample([1, 2, 4], 2, [-1.0], 1.0),  # A
        Sample([1, 2, 5], 2, [-1.0], 1.0),  # A
        Sample([1, 2, 6], 2, [-1.0], 0.0),  # A, not trained
        Sample([5, 6, 7], 2, [-1.0], 1.0),  # B
    ]
    trained = [s.advantage != 0 for s in samples]
    assert plan_micro_batches(samples, 5, trained) == [[[1, 5], [0, 2, 3]]]
    assert plan_micro_batches(samples, 4, trained) == [[[1, 5]], [[0, 2, 3]]]
    assert plan_micro_batches(samples, 2, trained) == [[[1, 5]], [[0, 2]], [[3]]]
    assert plan_micro_batches(samples, 1, trained) == [[[1]], [[0]], [[2]], [[3]], [[5]]]
    assert plan_micro_batches(samples, 4, [False] * len(samples)) == []


def test_a_token_budget_splits_micro_batches_and_large_groups() -> None:
    samples = [
        Sample([1, 2, 3, 3, 3], 2, [-1.0] * 3, 1.0),  # prompt A (2 tokens) + 3
        Sample([1, 2, 4], 2, [-1.0], 1.0),  # A + 1
        Sample([1, 2, 5, 5], 2, [-1.0] * 2, 1.0),  # A + 2
        Sample([7, 8, 9], 2, [-1.0], 1.0),  # prompt B (2 tokens) + 1
    ]
    trained = [True] * len(samples)
    # A's three samples need 2 + 3 + 1 + 2 = 8 tokens: at 7 they are split, the prompt in both rows.
    assert plan_micro_batches(samples, 8, trained, max_tokens=8) == [[[0, 1, 2]], [[3]]]
    assert plan_micro_batches(samples, 8, trained, max_tokens=7) == [[[0, 1]], [[2], [3]]]
    assert plan_micro_batches(samples, 8, trained, max_tokens=11) == [[[0, 1, 2], [3]]]
    # A sample longer than the budget runs alone instead of being refused.
    assert plan_micro_batches(samples, 8, trained, max_tokens=2) == [[[0]], [[2]], [[1]], [[3]]]
    assert plan_micro_batches(samples, 8, trained, max_tokens=None) == plan_micro_batches(samples, 8, trained)
