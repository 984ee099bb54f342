"""Speculative decoding: propose draft tokens cheaply, then verify them all in one target forward pass.

Two proposers: n-gram prompt lookup (drafts copied from the sequence's own context) and a smaller draft
model with its own runner and KV cache. `verify` accepts drafts exactly: greedy output is token for token
the target's, and sampled output follows the target's distribution (speculative rejection sampling). The
scheduler and block manager handle the KV of rejected drafts; this module never touches the target's cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch

from tether.engine.model_runner import ModelRunner, SequenceChunk
from tether.engine.sampling import SamplingParams, draw, probabilities, uniform
from tether.errors import ConfigError


class SpeculativeMode(Enum):
    NGRAM = "ngram"
    """Prompt lookup: copy what followed the most recent earlier occurrence of the context's last n-gram."""
    DRAFT = "draft"
    """A smaller draft model proposes the tokens, one forward pass per draft token."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    mode: SpeculativeMode | str = SpeculativeMode.NGRAM
    """Accepts the enum or its value; stored as the enum."""
    num_speculative_tokens: int = 4
    """Most draft tokens verified per sequence per step (k); a step emits at most k + 1 tokens."""
    ngram_min: int = 1
    """Shortest context suffix (in tokens) that n-gram lookup matches."""
    ngram_max: int = 4
    """Longest context suffix tried first by n-gram lookup."""
    draft_runner: ModelRunner | None = field(default=None, repr=False, compare=False)
    """The draft model with its own KV cache; required for mode "draft", must share the target's vocab."""

    def __post_init__(self) -> None:
        try:
            mode = SpeculativeMode(self.mode)
        except ValueError:
            accepted = ", ".join(repr(m.value) for m in SpeculativeMode)
            raise ConfigError(f"speculative: mode = {self.mode!r}: expected one of {accepted}") from None
        object.__setattr__(self, "mode", mode)
        for name, low, high in (
            ("num_speculative_tokens", 1, 64),
            ("ngram_min", 1, 64),
            ("ngram_max", 1, 64),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(
                    f"speculative: {name} = {value!r}: expected an integer from {low} to {high}"
                )
        if self.ngram_min > self.ngram_max:
            raise ConfigError(
                f"speculative: ngram_min = {self.ngram_min}: expected at most ngram_max ({self.ngram_max})"
            )
        if mode is SpeculativeMode.DRAFT and not isinstance(self.draft_runner, ModelRunner):
            raise ConfigError(
                f"speculative: draft_runner = {self.draft_runner!r}: mode 'draft' needs a ModelRunner"
            )
        if mode is SpeculativeMode.NGRAM and self.draft_runner is not None:
            raise ConfigError("speculative: draft_runner is set but mode is 'ngram': expected mode 'draft'")


@dataclass(slots=True)
class SpeculativeStats:
    num_drafted_tokens: int = 0
    """Draft tokens verified by the target."""
    num_accepted_tokens: int = 0
    """Of those, the ones accepted (counted before any cut at a stop)."""
    num_verify_steps: int = 0
    """Sequence-steps that verified at least one draft."""

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_drafted_tokens if self.num_drafted_tokens else 0.0


@dataclass(frozen=True, slots=True)
class DraftRequest:
    seq_id: int
    token_ids: list[int]
    """The sequence's tokens so far (read only)."""
    num_tokens: int
    """Most drafts wanted."""
    params: SamplingParams
    generator: torch.Generator | None


@dataclass(frozen=True, slots=True)
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None = None
    """[len(token_ids), vocab]: the distribution each draft was drawn from; None for a point mass."""


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> dict[int, Draft]: ...

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence."""


def find_ngram_draft(token_ids: list[int], num_tokens: int, ngram_min: int, ngram_max: int) -> list[int]:
    """The tokens that followed the most recent earlier occurrence of the longest matching context suffix."""
    length = len(token_ids)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = token_ids[length - n :]
        for start in range(length - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + num_tokens]
    return []


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, requests: list[DraftRequest]) -> dict[int, Draft]:
        drafts = {}
        for request in requests:
            tokens = find_ngram_draft(request.token_ids, request.num_tokens, self.ngram_min, self.ngram_max)
            if tokens:
                drafts[request.seq_id] = Draft(tokens)
        return drafts

    def release(self, seq_id: int) -> None:
        pass


@dataclass(slots=True)
class _DraftState:
    block_table: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    """Tokens whose KV is in the draft cache."""


class DraftModelProposer:
    """Runs the draft model k times per step over all proposing sequences, batched; its KV cache keeps each
    sequence's longest prefix still agreeing with the target's tokens."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._free = list(range(runner.kv_cache.num_blocks))
        self._states: dict[int, _DraftState] = {}

    def propose(self, requests: list[DraftRequest]) -> dict[int, Draft]:
        pending: dict[int, list[int]] = {}  # seq id -> tokens to feed next
        for request in requests:
            state = self._states.setdefault(request.seq_id, _DraftState())
            common = 0
            for mine, theirs in zip(state.token_ids, request.token_ids[:-1], strict=False):
                if mine != theirs:
                    break
                common += 1
            del state.token_ids[common:]
            self._trim(state, common)
            pending[request.seq_id] = request.token_ids[common:]
        by_id = {request.seq_id: request for request in requests}
        drafted: dict[int, list[int]] = {seq_id: [] for seq_id in pending}
        probs: dict[int, list[torch.Tensor]] = {seq_id: [] for seq_id in pending}
        while pending:
            chunks, order = [], []
            for seq_id, tokens in pending.items():
                state = self._states[seq_id]
                if not self._reserve(state, len(state.token_ids) + len(tokens)):
                    continue  # draft cache full: propose what is drafted so far
                chunks.append(SequenceChunk(tokens, len(state.token_ids), list(state.block_table)))
                order.append(seq_id)
            if not chunks:
                break
            # A few rows, read value by value here and in `verify`: one copy, not a device sync per read.
            rows = self.runner.step(chunks).cpu()
            pending = {}
            for seq_id, chunk, row in zip(order, chunks, rows, strict=True):
                request = by_id[seq_id]
                self._states[seq_id].token_ids.extend(chunk.token_ids)
                q = probabilities(row[None], request.params)[0]
                token = int(torch.argmax(row)) if request.params.greedy else draw(q, request.generator)
                drafted[seq_id].append(token)
                probs[seq_id].append(q)
                if len(drafted[seq_id]) < request.num_tokens:
                    pending[seq_id] = [token]
        return {
            seq_id: Draft(tokens, torch.stack(probs[seq_id])) for seq_id, tokens in drafted.items() if tokens
        }

    def release(self, seq_id: int) -> None:
        state = self._states.pop(seq_id, None)
        if state is not None:
            self._free.extend(state.block_table)

    def _reserve(self, state: _DraftState, num_tokens: int) -> bool:
        needed = -(-num_tokens // self.runner.block_size) - len(state.block_table)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            state.block_table.append(self._free.pop())
        return True

    def _trim(self, state: _DraftState, num_tokens: int) -> None:
        keep = -(-num_tokens // self.runner.block_size)
        self._free.extend(state.block_table[keep:])
        del state.block_table[keep:]


PROPOSERS: dict[SpeculativeMode, Callable[[SpeculativeConfig], Proposer]] = {
    SpeculativeMode.NGRAM: lambda config: NgramProposer(config.ngram_min, config.ngram_max),
    SpeculativeMode.DRAFT: lambda config: DraftModelProposer(_runner(config)),
}


def _runner(config: SpeculativeConfig) -> ModelRunner:
    assert config.draft_runner is not None
    return config.draft_runner


def make_proposer(config: SpeculativeConfig) -> Proposer:
    return PROPOSERS[SpeculativeMode(config.mode)](config)


@dataclass(frozen=True, slots=True)
class Verdict:
    token_ids: list[int]
    """Emitted tokens: the accepted drafts, then the target's own token."""
    logprobs: list[float]
    """The target's logprob of each emitted token (temperature-scaled, as `sampling.sample` reports)."""
    num_accepted: int


def verify(
    logits: torch.Tensor, draft: Draft, params: SamplingParams, generator: torch.Generator | None
) -> Verdict:
    """Accept or reject `draft` against the target's [len(draft) + 1, vocab] logits (row i predicts the
    token after draft i - 1). Greedy: accept while drafts equal the argmax. Sampled: accept draft x with
    probability min(1, p(x) / q(x)), on rejection draw from max(0, p - q) normalized."""
    assert logits.shape[0] == len(draft.token_ids) + 1, "one row per draft plus one"
    logits = logits.cpu()  # a few rows, read value by value: one copy, not a device sync per read
    logprobs = torch.log_softmax(logits if params.greedy else logits / params.temperature, dim=-1)
    p = probabilities(logits, params)
    emitted: list[int] = []
    accepted = 0
    for i, x in enumerate(draft.token_ids):
        if params.greedy:
            ok = int(torch.argmax(logits[i])) == x
        else:
            q_x = 1.0 if draft.probs is None else float(draft.probs[i, x])
            ok = float(uniform(generator, logits.device)) * q_x < float(p[i, x])
        if not ok:
            if params.greedy:
                emitted.append(int(torch.argmax(logits[i])))
            else:
                q = torch.zeros_like(p[i]) if draft.probs is None else draft.probs[i]
                if draft.probs is None:
                    q[x] = 1.0
                residual = (p[i] - q).clamp(min=0)
                total = float(residual.sum())
                residual = residual / total if total > 0 else p[i]
                emitted.append(draw(residual, generator))
            break
        emitted.append(x)
        accepted += 1
    else:
        last = logits[-1]
        if params.greedy:
            emitted.append(int(torch.argmax(last)))
        else:
            emitted.append(draw(p[-1], generator))
    return Verdict(emitted, [float(logprobs[i, t]) for i, t in enumerate(emitted)], accepted)
