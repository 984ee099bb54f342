"""`ContextFitter`: keep each model call's prompt within the task's token budget, its prefix stable.

The policy, over the journaled steps alone (so a resumed task is shown exactly what it would have been):
- The verbatim tail begins at a block boundary (a multiple of `recent_steps`), never before the count
  rule's (`folded_count`). When the tail outgrows its room (the budget less the system prompt, tools,
  header, recalled observations and the digest's share), blocks are folded until it fills at most half
  of it, so the next fold is many steps away. Between two folds the system prompt, header and digest
  are byte-identical and the tail only grows: each prompt begins with the previous one (but for the
  recalled observations, which come last) and the prefix cache hits. The folds are replayed step by
  step from the first over per-step token counts, then the whole prompt is counted; should it still
  not fit, the next boundaries are tried, then a fold of every step.
- The digest holds a line per folded step while it fits `digest_share` of the budget. When a fold takes
  it past that, its oldest lines are left out in whole blocks until it is back under half the share, so
  its beginning too changes once in many folds; the steps left out stay reachable through retrieval.
- Should nothing fit even with every step folded and the digest empty, the budget is too small for the
  task: `ContextBudgetError`.

Token counts come from the model's client where it can count (`tether.chat.tokens.PromptCounter`), else
from the byte estimate; no I/O happens here.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass

from tether.agents.context import (
    ContextPlan,
    build_messages,
    digest_line,
    folded_count,
    verbatim_steps,
)
from tether.agents.task import MIN_CONTEXT_BUDGET_TOKENS, RoleSpec, TaskSpec
from tether.chat import ChatRequest, ToolSpec
from tether.errors import ConfigError
from tether.store.records import JsonDict, StepRecord

CountTokens = Callable[[ChatRequest], int]


class ContextBudgetError(ConfigError):
    """A task's context budget cannot hold even its fixed part, or the model leaves no room for one."""


@dataclass(frozen=True, slots=True)
class FittedContext:
    messages: list[JsonDict]
    plan: ContextPlan
    prompt_tokens: int  # as counted for the budget: the model's own count where the client gives one


def step_budget(spec: TaskSpec, runner_cap_tokens: int | None, model_len_tokens: int | None) -> int:
    """The prompt tokens a step may send: the task's budget, within the runner's cap and within the
    model's context less the step's reply (`limits.max_output_tokens`)."""
    budget = spec.context.budget_tokens
    if runner_cap_tokens is not None:
        budget = min(budget, runner_cap_tokens)
    if model_len_tokens is not None:
        room = model_len_tokens - spec.limits.max_output_tokens
        if room < MIN_CONTEXT_BUDGET_TOKENS:
            raise ContextBudgetError(
                f"the model takes {model_len_tokens} tokens in all; after limits.max_output_tokens = "
                f"{spec.limits.max_output_tokens} that leaves {room} for the prompt, under the least "
                f"context budget ({MIN_CONTEXT_BUDGET_TOKENS}); lower limits.max_output_tokens"
            )
        budget = min(budget, room)
    return budget


class ContextFitter:
    """Fits contexts for one model; remembers the token count of each digest line it has measured."""

    def __init__(self, count: CountTokens) -> None:
        self._count = count
        # Committed steps never change: each digest line and verbatim step is counted once, not per call.
        self._text_tokens = functools.lru_cache(maxsize=65_536)(self._count_text)
        self._step_tokens = functools.lru_cache(maxsize=8192)(self._count_step)

    def _count_text(self, text: str) -> int:
        return self._count(ChatRequest([{"role": "user", "content": text}]))

    def _line_tokens(self, text: str) -> int:
        """A digest line's own tokens: its one-message count less the template's wrapping of a message."""
        return max(0, self._text_tokens(text) - self._text_tokens(""))

    def _count_step(self, messages_json: str) -> int:
        """A verbatim step's own tokens, its messages counted alone less one message's wrapping."""
        return max(0, self._count(ChatRequest(json.loads(messages_json))) - self._text_tokens(""))

    def fit(
        self,
        spec: TaskSpec,
        role: RoleSpec,
        steps: list[StepRecord],
        recalled: list[str],
        tools: tuple[ToolSpec, ...],
        budget_tokens: int,
    ) -> FittedContext:
        block, total = spec.context.recent_steps, len(steps)
        digest_cap = int(budget_tokens * spec.context.digest_share)
        fixed = self._render(spec, role, [], recalled, tools, ContextPlan(0)).prompt_tokens
        step_tokens = [self._step_tokens(json.dumps(shown)) for shown in verbatim_steps(spec, steps)]
        planned = planned_fold(
            [0, *itertools.accumulate(step_tokens)], block, budget_tokens - fixed - digest_cap
        )
        line_tokens = [self._line_tokens(digest_line(step, spec.context.summary_chars)) for step in steps]
        summed_lines = [0, *itertools.accumulate(line_tokens)]
        boundaries = list(range(planned, total + 1, block))
        for folded in [*boundaries, *([total] if boundaries[-1:] != [total] else [])]:
            plan = ContextPlan(folded, elided_steps(summed_lines, folded, block, digest_cap))
            fitted = self._render(spec, role, steps, recalled, tools, plan)
            if fitted.prompt_tokens <= budget_tokens:
                return fitted
        bare = self._render(spec, role, steps, recalled, tools, ContextPlan(total, total))
        if bare.prompt_tokens <= budget_tokens:
            return bare
        raise ContextBudgetError(
            f"context.budget_tokens: {budget_tokens} tokens cannot hold step {total}'s prompt even with "
            f"every step folded and the digest empty: the system prompt, tools, task header"
            f"{' and recalled observations' if recalled else ''} alone take {bare.prompt_tokens}; "
            "raise the budget or shorten the system prompt"
        )

    def _render(
        self,
        spec: TaskSpec,
        role: RoleSpec,
        steps: list[StepRecord],
        recalled: list[str],
        tools: tuple[ToolSpec, ...],
        plan: ContextPlan,
    ) -> FittedContext:
        messages = build_messages(spec, role, steps, recalled, plan)
        return FittedContext(messages, plan, self._count(ChatRequest(messages, tools=tools)))


def planned_fold(summed_step_tokens: list[int], block: int, tail_room: int) -> int:
    """Where the verbatim tail begins, replayed step by step from the first: at the count rule's boundary
    or later; once the tail outgrows `tail_room` (`summed_step_tokens[i]`: the tokens of the steps
    before i), at the first boundary that leaves it at most half of that (the last one, if none does)."""
    folded = 0
    for seen in range(1, len(summed_step_tokens)):
        folded = max(folded, folded_count(seen, block))
        if summed_step_tokens[seen] - summed_step_tokens[folded] <= tail_room:
            continue
        folded = next(
            (
                start
                for start in range(folded + block, seen + 1, block)
                if summed_step_tokens[seen] - summed_step_tokens[start] <= tail_room // 2
            ),
            (seen // block) * block,
        )
    return folded


def elided_steps(summed_line_tokens: list[int], folded: int, block: int, digest_cap: int) -> int:
    """How many of the oldest folded steps the digest leaves out, replayed fold by fold from the first:
    past `digest_cap`, whole blocks go until the rest is under half of it, but never the newest block
    (`summed_line_tokens[i]`: the tokens of the digest lines of steps before i)."""
    elided = 0
    ends = [*range(block, folded + 1, block), *([folded] if folded % block else [])]
    for end in ends:
        kept = summed_line_tokens[end] - summed_line_tokens[elided]
        if kept <= digest_cap:
            continue
        elided = next(
            (
                start
                for start in range(elided + block, end, block)
                if summed_line_tokens[end] - summed_line_tokens[start] <= digest_cap // 2
            ),
            # The cap is a target: the whole prompt's count is what must fit, so keep the newest block.
            max(elided, (end - 1) // block * block),
        )
    return elided
