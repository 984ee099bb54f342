"""One generation stream: its tokens, how many of them have KV in the cache, and the blocks holding it.

Data only: the scheduler moves a sequence between states and the block manager fills its block table;
sampling parameters, stop conditions and detokenization belong to the engine. n samples of one prompt
are n sequences sharing the prompt's blocks (`Scheduler.fork`).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum


class SequenceStatus(Enum):
    WAITING = "waiting"
    """Queued, holds no KV."""
    RUNNING = "running"
    """Holds KV blocks and is scheduled every step it has tokens to compute."""
    PREEMPTED = "preempted"
    """Queued again after its KV was dropped to free blocks; all its tokens will be computed again."""
    SWAPPED = "swapped"
    """Queued again after its KV was copied to the host tier; it is copied back when the sequence runs."""
    FINISHED = "finished"


class FinishReason(Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class Sequence:
    __slots__ = (
        "arrival",
        "block_table",
        "finish_reason",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "priority",
        "request_id",
        "seq_id",
        "status",
        "token_ids",
    )

    def __init__(
        self, seq_id: int, request_id: str, prompt_token_ids: Iterable[int], *, priority: int = 0
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.priority = priority
        """Higher is more important; ties are broken by arrival."""
        self.arrival = -1
        """Order of arrival, set by `Scheduler.add` and `Scheduler.fork`."""
        self.token_ids: list[int] = list(prompt_token_ids)
        """Prompt then output tokens."""
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        """Leading tokens whose KV is in the cache (counting those scheduled in the current step, speculative
        drafts included until `Scheduler.update_from_output` rolls back the rejected ones)."""
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache when the sequence was first admitted."""
        self.num_preemptions = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, status={self.status.name}, "
            f"priority={self.priority}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_prefill(self) -> bool:
        """True while some prompt token has no KV yet."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def fork(self, seq_id: int) -> Sequence:
        """A copy with the same request, priority and tokens; blocks are shared by `BlockManager.fork`."""
        child = Sequence(seq_id, self.request_id, self.prompt_token_ids, priority=self.priority)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        return child
