"""Continuous batching with chunked prefill, priorities and preemption by recomputation or swapping.

`schedule()` plans one step as plain data; the engine runs the model and reports back through
`update_from_output()`. The scheduler knows nothing about torch, tokenization or sampling, and the engine
decides when a sequence is finished (the scheduler only stops one that reaches `max_model_len`). Not
thread-safe: one engine loop calls `add`, `abort` and `fork` between or around its steps.

Policy. Importance is (priority, earlier arrival). Each step first gives every running sequence its next
tokens (one for decode, a chunk for an unfinished prefill), most important first, within the token
budget; when blocks run out, the least important running sequence is preempted until the current one
fits, possibly itself: its KV is dropped, to be computed again, or, when the `PreemptionChooser` says so
(`EngineConfig.preemption_mode` "swap" or "auto"), swapped out (`SchedulerOutput.swap_out`: the engine
copies those blocks to the host tier before the step writes any block) and swapped back in when it is
admitted again (`SchedulerOutput.swap_in`: copied into fresh blocks before the forward pass). If nothing
was preempted, waiting sequences are then admitted in order of importance while seats, budget and blocks
allow; a waiting sequence may preempt running ones of strictly lower priority for a seat or blocks.
Admission stops at the first waiting sequence that cannot be placed, so lower-priority ones never jump
ahead of it. One exception: a waiting sequence whose next uncached prompt block is being computed by a
running prefill is deferred (skipped, not blocking) until that block reaches the prefix cache, so
requests arriving together with a shared system prompt compute it once instead of once each.

Sliding windows. Built with `kv_window` (every layer of the model slides, the largest window), the
scheduler gives back, after each step, the blocks of a running sequence that fell wholly behind the window
of its next token (`BlockManager.release_behind_window`): a long sequence then holds about window /
block_size blocks however long it grows.

Weight updates. `recompute_all()` drops every running sequence's KV between steps, as a preemption of
all of them: after new weights arrive, old KV must not be attended to.

Speculation. A decoding sequence may be given draft tokens (`schedule(drafts)`): they ride in its chunk
after its last token when budget, `max_model_len` and free blocks allow (drafts never cause preemption),
and `update_from_output` rolls back the KV of the drafts the engine rejected before caching any block.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from tether.block_hash import BlockHash
from tether.engine.block_manager import BlockCopy, BlockManager
from tether.engine.config import EngineConfig, PreemptionMode
from tether.engine.scheduler_output import (
    PreemptionChooser,
    ScheduledChunk,
    SchedulerOutput,
    SwapIn,
    SwapOut,
)
from tether.engine.sequence import FinishReason, Sequence, SequenceStatus
from tether.errors import TetherError


class RequestError(TetherError, ValueError):
    """A request the engine cannot serve (empty prompt, prompt too long, duplicate id)."""


@dataclass(slots=True)
class _Plan:
    budget: int
    chunks: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq_id -> (start, num_tokens)
    copies: dict[int, list[BlockCopy]] = field(default_factory=dict)
    preempted: list[int] = field(default_factory=list)
    drafts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    swap_out: list[SwapOut] = field(default_factory=list)
    swap_in: list[SwapIn] = field(default_factory=list)


def _importance(seq: Sequence) -> tuple[int, int]:
    """Sort key: most important first."""
    return (-seq.priority, seq.arrival)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager | None = None,
        choose_preemption: PreemptionChooser | None = None,
        kv_window: int | None = None,
    ) -> None:
        if config.preemption is not PreemptionMode.RECOMPUTE and choose_preemption is None:
            raise ValueError(f"preemption_mode {config.preemption.value!r} needs a choose_preemption")
        self.config = config
        self._choose_preemption = choose_preemption
        self.kv_window = kv_window
        """Tokens behind its next token a sequence's KV must keep (None: all): `ModelConfig.kv_window`."""
        self.block_manager = block_manager if block_manager is not None else BlockManager.from_config(config)
        assert self.block_manager.block_size == config.block_size
        self._seqs: dict[int, Sequence] = {}
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._next_arrival = 0
        self.num_preemptions = 0
        """Preemptions since construction."""
        self.num_swap_preemptions = 0
        """Of those, the ones that swapped the sequence's KV out instead of dropping it."""
        self.num_recomputed_tokens = 0
        """Tokens whose computed KV was dropped (by preemption or `recompute_all`), to be computed again."""
        self._swapped: dict[int, int] = {}  # swapped-out sequence -> tokens of KV the host tier holds
        self._may_sample: set[int] = set()  # sequences that may receive a token in update_from_output

    @property
    def waiting(self) -> list[Sequence]:
        return list(self._waiting)

    @property
    def running(self) -> list[Sequence]:
        return list(self._running)

    @property
    def num_unfinished(self) -> int:
        return len(self._seqs)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def get(self, seq_id: int) -> Sequence | None:
        return self._seqs.get(seq_id)

    def check(self, seq: Sequence) -> None:
        """Raise `RequestError` if `add` would refuse the sequence (for callers that hold it back first)."""
        if seq.seq_id in self._seqs:
            raise RequestError(f"sequence id {seq.seq_id} is already queued or running")
        if not 0 < seq.num_tokens < self.config.max_model_len:
            raise RequestError(
                f"request {seq.request_id!r}: prompt of {seq.num_tokens} tokens: expected 1 to "
                f"{self.config.max_model_len - 1} (max_model_len {self.config.max_model_len} less one)"
            )

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; it joins the batch at the next `schedule()`."""
        self.check(seq)
        assert seq.status is SequenceStatus.WAITING and not seq.block_table and seq.num_computed_tokens == 0
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        self._seqs[seq.seq_id] = seq
        self._waiting.append(seq)

    def fork(self, parent_seq_id: int, child_seq_id: int) -> Sequence:
        """A new sequence sharing the parent's tokens and blocks, for n samples of one prompt.

        Call between `schedule()` and `update_from_output()` for a parent whose chunk samples this step,
        then report a sampled token for the child too. Without a free seat the child waits and computes its
        tokens again later (mostly from the prefix cache).
        """
        parent = self._seqs.get(parent_seq_id)
        if parent is None or parent_seq_id not in self._may_sample:
            raise ValueError(f"sequence {parent_seq_id} does not sample this step and cannot be forked")
        if child_seq_id in self._seqs:
            raise RequestError(f"sequence id {child_seq_id} is already queued or running")
        child = parent.fork(child_seq_id)
        child.arrival = self._next_arrival
        self._next_arrival += 1
        self._seqs[child_seq_id] = child
        self._may_sample.add(child_seq_id)
        if len(self._running) < self.config.max_num_seqs:
            self.block_manager.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            self._running.append(child)
        else:
            child.num_computed_tokens = 0
            child.status = SequenceStatus.WAITING
            self._waiting.append(child)
        return child

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of the request and free its blocks; call between steps."""
        seqs = [seq for seq in self._seqs.values() if seq.request_id == request_id]
        for seq in seqs:
            self._finish(seq, FinishReason.ABORT)
        return seqs

    def recompute_all(self) -> list[Sequence]:
        """Drop the KV of every running sequence (after a weight update it belongs to the old weights): each
        keeps its tokens and waits to compute them all again. Call between steps; returns those dropped."""
        assert not self._may_sample, "recompute_all is called between steps"
        dropped = sorted(self._running, key=_importance)
        for seq in dropped:
            self.block_manager.free(seq)
            self.num_recomputed_tokens += seq.num_computed_tokens
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.PREEMPTED
        self._running.clear()
        self._waiting.extend(dropped)
        # Swapped-out KV is of the old weights too: those sequences compute everything again.
        for seq in self._waiting:
            if seq.status is SequenceStatus.SWAPPED:
                self.num_recomputed_tokens += self._swapped.pop(seq.seq_id)
                seq.status = SequenceStatus.PREEMPTED
                dropped.append(seq)
        return dropped

    def schedule(self, drafts: Mapping[int, Seq[int]] | None = None) -> SchedulerOutput:
        """Plan one step; `drafts` maps a decoding sequence to speculative tokens to verify after it."""
        plan = _Plan(budget=self.config.max_num_batched_tokens)
        self._may_sample.clear()
        self._running.sort(key=_importance)
        running = list(self._running)
        for index, seq in enumerate(running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted for a more important one earlier in this loop
            num_tokens = min(seq.num_uncomputed_tokens, plan.budget)
            if num_tokens == 0:
                continue
            while not self.block_manager.can_allocate(seq, num_tokens):
                victim = max(self._running, key=_importance)
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                # Leave one token of budget for each running sequence after this one.
                spare = plan.budget - num_tokens - (len(running) - index - 1)
                draft = self._fit_draft(seq, (drafts or {}).get(seq.seq_id, ()), spare)
                self._place(seq, num_tokens, [], plan, draft)
        if not plan.preempted:
            in_flight = self._blocks_in_flight(plan)
            for seq in sorted(self._waiting, key=_importance):
                if plan.budget == 0:
                    break
                if seq.seq_id not in self._swapped and self._shares_block_in_flight(seq, in_flight):
                    continue
                if not self._admit(seq, plan):
                    break
                in_flight.update(self.block_manager.prompt_block_hashes(seq, 0))
        return self._output(plan)

    def _blocks_in_flight(self, plan: _Plan) -> set[BlockHash]:
        """Hashes of prompt blocks that running prefills compute in this step or later, not yet cached."""
        size = self.config.block_size
        in_flight: set[BlockHash] = set()
        for seq in self._running:
            start = plan.chunks[seq.seq_id][0] if seq.seq_id in plan.chunks else seq.num_computed_tokens
            if start < seq.num_prompt_tokens:
                in_flight.update(self.block_manager.prompt_block_hashes(seq, start // size))
        return in_flight

    def _shares_block_in_flight(self, seq: Sequence, in_flight: set[BlockHash]) -> bool:
        """Whether the first prompt block `seq` would compute itself is already being computed."""
        if not in_flight:
            return False
        cached = len(self.block_manager.find_cached_prefix(seq))
        upcoming = self.block_manager.prompt_block_hashes(seq, cached)
        return bool(upcoming) and upcoming[0] in in_flight

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: Mapping[int, int | Seq[int] | None],
        finished: Mapping[int, FinishReason],
    ) -> list[Sequence]:
        """Apply a step's results: append tokens, roll back rejected drafts, cache computed blocks, free
        finished sequences.

        `sampled` maps a sequence to its new token (None: none this step), or, for a chunk with drafts, to
        the tokens it emits: the accepted drafts then the target's own token, possibly cut short at a stop.
        `finished` maps a sequence to why the engine stopped it. Sequences aborted since `schedule()` are
        ignored. Returns the sequences finished now.
        """
        with_drafts = {chunk.seq_id: chunk for chunk in output.chunks if chunk.draft_token_ids}
        to_finish = dict(finished)
        for seq_id, tokens in sampled.items():
            seq = self._seqs.get(seq_id)
            if tokens is None or seq is None:
                continue
            if seq_id not in self._may_sample:
                raise ValueError(f"sequence {seq_id} did not sample this step; got token {tokens}")
            new = [tokens] if isinstance(tokens, int) else list(tokens)
            limit = len(with_drafts[seq_id].draft_token_ids) + 1 if seq_id in with_drafts else 1
            if not 1 <= len(new) <= limit:
                raise ValueError(f"sequence {seq_id}: got tokens {new}: expected 1 to {limit} this step")
            for token_id in new:
                seq.append_token(token_id)
            if seq.num_tokens >= self.config.max_model_len:
                to_finish.setdefault(seq_id, FinishReason.LENGTH)
        for seq_id, chunk in with_drafts.items():
            seq = self._seqs.get(seq_id)
            if seq is not None and seq.status is SequenceStatus.RUNNING:
                self._roll_back_drafts(seq, chunk)
        for chunk in output.chunks:
            seq = self._seqs.get(chunk.seq_id)
            if seq is not None and seq.status is SequenceStatus.RUNNING:
                self.block_manager.cache_full_blocks(seq)
                if self.kv_window is not None:
                    self.block_manager.release_behind_window(seq, self.kv_window)
        self._may_sample.clear()
        done = []
        for seq_id, reason in to_finish.items():
            seq = self._seqs.get(seq_id)
            if seq is not None:
                self._finish(seq, reason)
                done.append(seq)
        return done

    def _admit(self, seq: Sequence, plan: _Plan) -> bool:
        """Start computing a waiting sequence, preempting lower-priority ones if needed."""
        restored = self._swapped.get(seq.seq_id, 0)
        while True:
            # A swapped-out sequence holds (in the host tier) the KV of its first `restored` tokens.
            prefix = [] if restored else self.block_manager.find_cached_prefix(seq)
            start = restored or len(prefix) * self.config.block_size
            num_tokens = min(seq.num_tokens - start, plan.budget)
            if len(self._running) < self.config.max_num_seqs and self.block_manager.can_allocate(
                seq, restored + num_tokens, prefix
            ):
                break
            victim = max(self._running, key=_importance, default=None)
            if victim is None or victim.priority >= seq.priority:
                return False
            self._preempt(victim, plan)
        self._waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self._running.append(seq)
        if restored:
            del self._swapped[seq.seq_id]
            plan.swap_in.append(SwapIn(seq.seq_id, self.block_manager.allocate_restored(seq, restored)))
        self._place(seq, num_tokens, prefix, plan)
        return True

    def _fit_draft(self, seq: Sequence, draft: Seq[int], spare: int) -> tuple[int, ...]:
        """The leading drafts that fit: only after a decoding sequence's last token, within the spare
        budget, below `max_model_len` (room for the target's own token) and in the free blocks."""
        if not draft or seq.num_uncomputed_tokens != 1 or seq.is_prefill:
            return ()
        limit = min(len(draft), spare, self.config.max_model_len - seq.num_tokens - 1)
        fitted = tuple(draft[: max(0, limit)])
        if fitted and not self.block_manager.can_allocate(seq, 1 + len(fitted)):
            return ()
        return fitted

    def _place(
        self, seq: Sequence, num_tokens: int, prefix: list[int], plan: _Plan, draft: tuple[int, ...] = ()
    ) -> None:
        total = num_tokens + len(draft)
        copies = self.block_manager.allocate(seq, total, prefix)
        if copies:
            plan.copies[seq.seq_id] = copies
        plan.chunks[seq.seq_id] = (seq.num_computed_tokens, total)
        if draft:
            plan.drafts[seq.seq_id] = draft
        seq.num_computed_tokens += total
        plan.budget -= total

    def _roll_back_drafts(self, seq: Sequence, chunk: ScheduledChunk) -> None:
        """Count as computed only the drafts now in the sequence, and never its newest token (the next step
        must compute it to get logits); release the blocks past them. Called after appending the tokens."""
        first = chunk.end - len(chunk.draft_token_ids)  # position of the first draft
        matched = 0
        for draft, token in zip(
            chunk.draft_token_ids, seq.token_ids[first : seq.num_tokens - 1], strict=False
        ):
            if draft != token:
                break
            matched += 1
        seq.num_computed_tokens = min(first + matched, seq.num_tokens - 1)
        self.block_manager.trim(seq, seq.num_computed_tokens)

    def _preempt(self, seq: Sequence, plan: _Plan) -> None:
        if seq.seq_id in plan.chunks:  # scheduled earlier in this step: give its budget back
            start, num_tokens = plan.chunks.pop(seq.seq_id)
            plan.budget += num_tokens
            plan.copies.pop(seq.seq_id, None)
            plan.drafts.pop(seq.seq_id, None)
            seq.num_computed_tokens = start  # the chunk's KV was never computed
        swap_in = next((s for s in plan.swap_in if s.seq_id == seq.seq_id), None)
        if swap_in is not None:  # admitted with a swap-in this step: its KV is still in the host tier
            plan.swap_in.remove(swap_in)
            self._swapped[seq.seq_id] = seq.num_computed_tokens
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.SWAPPED
            self._running.remove(seq)
            self._waiting.append(seq)
            plan.preempted.append(seq.seq_id)
            return
        computed = seq.num_computed_tokens
        num_blocks = -(-computed // self.config.block_size)
        mode = PreemptionMode.RECOMPUTE
        if computed and self._choose_preemption is not None:
            mode = self._choose_preemption(seq.seq_id, num_blocks, computed)
        if mode is PreemptionMode.SWAP:
            plan.swap_out.append(SwapOut(seq.seq_id, seq.block_table[:num_blocks], computed))
            self._swapped[seq.seq_id] = computed
            self.num_swap_preemptions += 1
            seq.status = SequenceStatus.SWAPPED
        else:
            self.num_recomputed_tokens += computed
            seq.status = SequenceStatus.PREEMPTED
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._running.remove(seq)
        self._waiting.append(seq)
        plan.preempted.append(seq.seq_id)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.block_manager.free(seq)
        self._swapped.pop(seq.seq_id, None)
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]
        self._may_sample.discard(seq.seq_id)

    def _output(self, plan: _Plan) -> SchedulerOutput:
        chunks = []
        for seq_id, (start, num_tokens) in plan.chunks.items():
            seq = self._seqs[seq_id]
            draft = plan.drafts.get(seq_id, ())
            known = num_tokens - len(draft)
            samples = start + known == seq.num_tokens
            if samples:
                self._may_sample.add(seq_id)
            chunks.append(
                ScheduledChunk(
                    seq_id=seq_id,
                    start=start,
                    num_tokens=num_tokens,
                    block_table=list(seq.block_table),
                    samples=samples,
                    token_ids=seq.token_ids[start : start + known] + list(draft),
                    draft_token_ids=draft,
                )
            )
        copies = [copy for seq_copies in plan.copies.values() for copy in seq_copies]
        return SchedulerOutput(
            chunks=chunks,
            preempted=plan.preempted,
            copies=copies,
            swap_out=plan.swap_out,
            swap_in=plan.swap_in,
        )
