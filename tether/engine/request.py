"""A request inside the engine: what it hands back (`RequestOutput` of `Completion`s) and the state of
each of its samples (generator, detokenizer, grammar matcher), advanced one recorded token at a time.

Plain bookkeeping: the engine decides which tokens are drawn; this module never touches the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tether.engine.detokenizer import IncrementalDetokenizer
from tether.engine.grammar import Grammar
from tether.engine.sampling import SamplingParams
from tether.engine.sequence import FinishReason

if TYPE_CHECKING:
    from llguidance import LLMatcher


@dataclass(slots=True)
class Completion:
    """One sample of a request, as generated so far."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # policy version of each token
    text: str = ""
    finish_reason: FinishReason | None = None
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per token, the request's `top_logprobs` most likely (token id, logprob), most likely first, under
    the distribution of `logprobs` (`sampling.top_alternatives`); empty when it asked for none."""

    @property
    def policy_versions(self) -> tuple[int, ...]:
        """The versions this completion spans, ascending: more than one only under `pause_resume` (or
        `abort_and_retry` past `max_retries`)."""
        return tuple(sorted(set(self.versions)))


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    num_cached_tokens: int
    retries: int = 0
    """Restarts from the prompt because a weight update aborted the request (`abort_and_retry`); the
    completions hold only the last attempt."""

    @property
    def finished(self) -> bool:
        return all(completion.finish_reason is not None for completion in self.completions)


def sample_seeds(params: SamplingParams, generator: torch.Generator) -> list[int]:
    """The seed of each sample's generator: `params.seed + i`, or a base drawn from `generator` per
    sample when the request names none."""
    seeds = []
    for index in range(params.n):
        base = (
            params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=generator))
        )
        seeds.append(base + index)
    return seeds


@dataclass(slots=True)
class EngineRequest:
    output: RequestOutput
    params: SamplingParams
    priority: int
    seeds: list[int]  # of each sample's generator, kept to restart the request identically
    stop_token_ids: frozenset[int]  # the request's own and, unless it ignores EOS, the model's EOS
    detokenize: Callable[[list[int]], str] | None = None
    grammar: Grammar | None = None
    seq_index: dict[int, int] = field(default_factory=dict)  # seq id -> completion index
    generators: list[torch.Generator | None] = field(default_factory=list)
    detokenizers: list[IncrementalDetokenizer] | None = None
    forked: bool = False
    matchers: list[LLMatcher] | None = None  # one per sample, advanced by each token it records

    def restart(self, seq_id: int, device: torch.device) -> None:
        """(Re)set the samples to nothing generated, with sequence `seq_id` as the first."""
        n = self.params.n
        self.output.completions[:] = [Completion(i) for i in range(n)]
        self.seq_index = {seq_id: 0}
        # On the device the logits come out on: the draw then stays there (`sampling.draw`), and the same
        # seeds restart a request (abort_and_retry) with the same tokens.
        self.generators = [
            None if self.params.greedy else torch.Generator(device=device).manual_seed(seed)
            for seed in self.seeds
        ]
        detokenize = self.detokenize
        self.detokenizers = (
            None if detokenize is None else [IncrementalDetokenizer(detokenize) for _ in range(n)]
        )
        self.forked = False
        # Fresh matchers: a restarted sample follows its grammar from the start again.
        self.matchers = None if self.grammar is None else [self.grammar.matcher() for _ in range(n)]

    def matcher(self, seq_id: int) -> LLMatcher | None:
        """The grammar matcher of the sample sequence `seq_id` is, if the request has a grammar."""
        return None if self.matchers is None else self.matchers[self.seq_index[seq_id]]

    def record(
        self,
        index: int,
        token: int,
        logprob: float,
        alternatives: list[tuple[int, float]] | None,
        version: int,
    ) -> FinishReason | None:
        """Append a token drawn for sample `index` under policy `version`; why the sample ends, if it does."""
        params = self.params
        completion = self.output.completions[index]
        completion.token_ids.append(token)
        completion.logprobs.append(logprob)
        completion.versions.append(version)
        if alternatives is not None:
            completion.top_logprobs.append(alternatives)
        complete = False
        if self.matchers is not None:
            matcher = self.matchers[index]
            accepted = matcher.consume_token(token)
            assert accepted, f"token {token} was outside its grammar's mask: {matcher.get_error()}"
            complete = matcher.is_stopped()  # nothing but EOS could follow
        if complete or token in self.stop_token_ids:
            reason: FinishReason | None = FinishReason.STOP
        elif len(completion.token_ids) >= params.max_tokens:
            reason = FinishReason.LENGTH
        else:
            reason = None
        if self.detokenizers is not None and self.detokenize is not None:
            if reason is None:
                completion.text = self.detokenizers[index].update(completion.token_ids)
            else:  # the last token may end inside a character: the final text is the whole decode
                completion.text = self.detokenize(completion.token_ids)
            for stop in params.stop:
                cut = completion.text.find(stop)
                if cut != -1:
                    completion.text = completion.text[:cut]
                    reason = FinishReason.STOP
        if reason is not None:
            completion.finish_reason = reason
        return reason
