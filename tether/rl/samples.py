"""The samples a learner step trains on, and how a step plans them into micro-batches.

A `Sample` is one sequence to learn from (prompt + completion ids, the engine's behaviour logprobs, the
advantage, which tokens carry loss), checked on construction. The planning is pure Python over token
counts, no torch: the samples to train are grouped by prompt (`prompt_groups`), so that the samples of
one prompt share a row in the packed forward (the prompt computed once), and the rows are filled into
micro-batches bounded in samples and tokens (`plan_micro_batches`). The learner (`learner.py`) computes
the micro-batches; the sharded learner (`sharded.py`) splits whole prompt groups across its ranks. This
module knows nothing of models, devices or losses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sample:
    """One sequence to learn from: its ids, where the completion starts, and what the loss needs."""

    token_ids: list[int]  # prompt + completion
    completion_start: int
    behaviour_logprobs: list[float]  # one per completion token
    advantage: float
    loss_mask: list[bool] | None = None  # per completion token; None: every token (single-turn)
    stale: bool = False  # generated (in part) by older weights than the learner's: truncated IS applies

    def __post_init__(self) -> None:
        completion = len(self.token_ids) - self.completion_start
        if not 1 <= self.completion_start < len(self.token_ids):
            raise ValueError(
                f"completion_start {self.completion_start} must leave a prompt and a completion in "
                f"{len(self.token_ids)} tokens"
            )
        lengths = {"behaviour_logprobs": len(self.behaviour_logprobs)}
        if self.loss_mask is not None:
            lengths["loss_mask"] = len(self.loss_mask)
        for name, length in lengths.items():
            if length != completion:
                raise ValueError(f"{name} has {length} entries for {completion} completion tokens")


Row = list[int]  # indices of samples sharing one prompt: one prompt document and its completions


def row_tokens(samples: Sequence[Sample], row: Row) -> int:
    """The tokens of one row: its shared prompt once, then each sample's completion."""
    first = samples[row[0]]
    return first.completion_start + sum(len(samples[i].token_ids) - samples[i].completion_start for i in row)


def _split(samples: Sequence[Sample], members: Row, size: int, max_tokens: int | None) -> list[Row]:
    """A prompt's samples in rows of at most `size` samples and `max_tokens` tokens (a sample longer
    than that alone), in order."""
    rows: list[Row] = []
    for index in members:
        row = rows[-1] if rows else []
        if (
            not row
            or len(row) == size
            or (max_tokens is not None and row_tokens(samples, [*row, index]) > max_tokens)
        ):
            rows.append([])
        rows[-1].append(index)
    return rows


def prompt_groups(samples: Sequence[Sample], trained: Sequence[bool]) -> list[Row]:
    """The `trained` samples grouped by their prompt (its token ids), in order of first appearance."""
    groups: dict[tuple[int, ...], Row] = {}
    for index, sample in enumerate(samples):
        if trained[index]:
            groups.setdefault(tuple(sample.token_ids[: sample.completion_start]), []).append(index)
    return list(groups.values())


def plan_micro_batches(
    samples: Sequence[Sample], size: int, trained: Sequence[bool], max_tokens: int | None = None
) -> list[list[Row]]:
    """The rows of each micro-batch: the `trained` samples grouped by prompt, at most `size` samples and
    (if set) `max_tokens` tokens per batch.

    Samples of one prompt share a row (the prompt once, then each completion attending to it), so the n
    samples of a GRPO group cost P + n*C tokens instead of n*(P + C); a group over either bound is split.
    Rows go longest first, each into the current micro-batch while it fits, so that a token budget is
    filled by rows of similar length."""
    assert size >= 1 and len(trained) == len(samples)
    assert max_tokens is None or max_tokens >= 1
    rows = [
        row
        for members in prompt_groups(samples, trained)
        for row in _split(samples, members, size, max_tokens)
    ]
    rows.sort(key=lambda row: row_tokens(samples, row), reverse=True)
    batches: list[list[Row]] = []
    count = size  # sequences in the last batch: start a new one at the first row
    tokens = 0  # tokens in the last batch
    for row in rows:
        length = row_tokens(samples, row)
        if count + len(row) > size or (max_tokens is not None and tokens + length > max_tokens):
            batches.append([])
            count = tokens = 0
        batches[-1].append(row)
        count += len(row)
        tokens += length
    return batches
