"""Multi-turn rollouts, token in and token out: turn k+1's prompt is turn k's prompt and generated ids
followed by the tokenized observation, never a re-tokenization of decoded text.

Every prompt is rendered by the model's `ChatTemplate` with the task's tools (natively when the template
knows tools, else in the Hermes text convention), and every reply is read by the template's tool-call
format, so a model is trained on the format it is served with; a malformed call reaches the episode as a
call to `MALFORMED_TOOL`, which the episode answers with an error the model sees. `ObservationEncoder`
renders tool results as the token suffix the template puts after an assistant turn; `assemble` lays the
turns of an episode out as one token sequence with a loss mask (generated tokens 1, observation tokens
0), the behaviour logprob and policy version of every generated token. `EpisodeDriver` runs many
episodes through one engine as a continuous batch: every turn is a request, submitted as soon as its
episode's tool calls return, so no episode waits for another, and an episode that fails for an
infrastructure reason runs again with the same seeds. Tools run through the environment's `Episode`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from tether.chat import Message, Messages, ToolSpec
from tether.chat.template import ChatTemplate
from tether.engine.sampling import SamplingParams
from tether.engine.sequence import FinishReason
from tether.envs.context import ScoringContext
from tether.envs.episode import Episode
from tether.envs.registry import EnvRegistry
from tether.envs.scoring import Score
from tether.envs.tasks import Task
from tether.rl.retries import RetryPolicy, describe, infra_reason, valid_score, within_deadline
from tether.rl.rollout import (
    PromptPlan,
    Rollout,
    Turn,
    billed_prompts,
    derive_seed,
    encode_prompt,
    task_tools,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tether.engine.llm_engine import LLMEngine, RequestOutput

# Turns the decoded text of a reply into the assistant message the environment steps with.
ReplyParser = Callable[[str, Task], Message]
# A conversation whose assistant turn is known, to find what the template writes around one.
_REPLY = "tether-probe-reply"
_PROBE: Messages = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": _REPLY},
]


def template_reply(template: ChatTemplate) -> ReplyParser:
    """Replies read by the template's tool-call format when the task offers tools (malformed blocks
    become `MALFORMED_TOOL` calls); a task without tools takes the text as it is."""

    def parse(text: str, task: Task) -> Message:
        if not task.tools:
            return {"role": "assistant", "content": text}
        return template.tool_format().parse(text).message()

    return parse


class ObservationEncoder:
    """Token ids that follow a generated assistant turn: the rest of the template's turn delimiters, the
    observation messages and the next generation prompt, exactly as the chat template renders them."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        self.tokenizer = template.tokenizer
        self._bases: dict[str, str] = {}  # the probe rendered with each tool set, by its JSON

    def _base(self, tools: tuple[ToolSpec, ...]) -> str:
        key = json.dumps([tool.openai() for tool in tools], sort_keys=True)
        if key not in self._bases:
            self._bases[key] = self.template.render(_PROBE, tools, generation_prompt=False)
        return self._bases[key]

    def encode(self, observation: Messages, last_token: int, tools: tuple[ToolSpec, ...] = ()) -> list[int]:
        """The suffix after a turn whose last generated token is `last_token`, in an episode offering
        `tools` (a template may render results differently once tools are known).

        A turn that ended on the template's end-of-turn token continues with what the template writes
        after that token; a turn cut short (by max_tokens) gets the template's whole closing first."""
        if not observation:
            raise ValueError("an observation needs at least one message")
        base = self._base(tools)
        full = self.template.render(_PROBE + observation, tools, generation_prompt=True)
        if not full.startswith(base):
            raise ValueError(
                "the chat template renders an earlier turn differently once more messages follow; "
                "observations cannot be appended as a token suffix with it"
            )
        # What the template writes after an assistant message's content, e.g. "<|im_end|>\n".
        closing = base[base.rindex(_REPLY) + len(_REPLY) :]
        end_text = str(self.tokenizer.decode([last_token]))
        if end_text and closing.startswith(end_text):
            closing = closing[len(end_text) :]
        ids = self.tokenizer.encode(closing + full[len(base) :], add_special_tokens=False)
        return [int(i) for i in ids]


@dataclass(frozen=True, slots=True)
class Trajectory:
    """An episode as one sequence: `prompt_ids` then `completion_ids`, every list below aligned with the
    completion. Observation tokens have loss_mask False, logprob 0.0 and version -1."""

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    versions: list[int]


def assemble(turns: Sequence[Turn]) -> Trajectory:
    """Lay the turns out as one sequence; each turn's prompt must extend the previous turn's tokens."""
    if not turns:
        raise ValueError("an episode needs at least one turn")
    first = turns[0]
    ids, mask, logprobs, versions = [], [], [], []
    previous = list(first.prompt_ids)
    for turn in turns:
        if turn.prompt_ids[: len(previous)] != previous or len(turn.prompt_ids) < len(previous):
            raise ValueError("a turn's prompt does not extend the episode's previous tokens")
        observed = turn.prompt_ids[len(previous) :]
        ids += observed + turn.completion_ids
        mask += [False] * len(observed) + [True] * len(turn.completion_ids)
        logprobs += [0.0] * len(observed) + list(turn.logprobs)
        versions += [-1] * len(observed) + list(turn.versions)
        previous = turn.prompt_ids + turn.completion_ids
    return Trajectory(list(first.prompt_ids), ids, mask, logprobs, versions)


@dataclass(slots=True)
class _Live:
    """An episode in flight; after an infrastructure failure it starts again (`retry_reasons`)."""

    plan: PromptPlan
    sample: int
    task: Task
    first_prompt: list[int]
    ctx: ScoringContext  # the batch's: each try of the episode gets a child of it
    episode: Episode | None = None
    prompt: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    retry_reasons: list[str] = field(default_factory=list)
    rollout: Rollout | None = None


@dataclass(slots=True)
class EpisodeDriver:
    """Runs episodes as a continuous batch on one engine (see the module docstring).

    An episode that fails for a reason not the model's (the sandbox failed a run or a session, a tool or
    the environment raised, its score was late or invalid: `retries.py`) runs again from its first turn
    with the same seeds, up to `retry.infra_retries` times; then its rollout is marked infra-failed."""

    engine: LLMEngine
    tokenizer: PreTrainedTokenizerBase
    registry: EnvRegistry
    params: SamplingParams  # per turn; n episodes per plan
    parse_reply: ReplyParser | None = None  # None: the template's tool-call format (`template_reply`)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    template: ChatTemplate = field(init=False)
    encoder: ObservationEncoder = field(init=False)
    _reply: ReplyParser = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.template = ChatTemplate(self.tokenizer)
        self.encoder = ObservationEncoder(self.template)
        self._reply = self.parse_reply or template_reply(self.template)

    async def run(self, plans: Sequence[PromptPlan], ctx: ScoringContext) -> tuple[list[Task], list[Rollout]]:
        """Every plan's n episodes, scored; rollouts come n per plan, in plan order."""
        tasks = [self.registry.get(plan.env).task(plan.seed) for plan in plans]
        # Rendered before any episode opens a session: a template that cannot render the tools fails here.
        prompts = [encode_prompt(self.template, task) for task in tasks]
        live = [
            _Live(plan, i, task, list(prompt), ctx)
            for plan, task, prompt in zip(plans, tasks, prompts, strict=True)
            for i in range(self.params.n)
        ]
        started = await asyncio.gather(*(self._start(episode) for episode in live))
        ready = [episode for episode, ok in zip(live, started, strict=True) if ok]
        in_engine: dict[str, _Live] = {}
        stepping: set[asyncio.Task[None]] = set()
        try:
            while ready or in_engine or stepping:
                for episode in ready:
                    in_engine[self._submit(episode)] = episode
                ready.clear()  # the same list: the steps in flight append to it
                if in_engine:
                    # Tool calls proceed between steps (or, on an accelerator, during them).
                    for output in await self.engine.step_async():
                        if output.finished and output.request_id in in_engine:
                            episode = in_engine.pop(output.request_id)
                            stepping.add(asyncio.create_task(self._advance(episode, output, ready)))
                else:
                    await asyncio.wait(stepping, return_when=asyncio.FIRST_COMPLETED)
                for task in [t for t in stepping if t.done()]:
                    stepping.discard(task)
                    task.result()  # an unexpected failure stops the batch (cleaned up below)
        finally:
            for request_id in in_engine:
                self.engine.abort(request_id)
            for task in stepping:
                task.cancel()
            await asyncio.gather(*stepping, return_exceptions=True)
            await asyncio.gather(*(e.episode.close() for e in live if e.episode), return_exceptions=True)
        rollouts = [episode.rollout for episode in live]
        assert all(r is not None for r in rollouts), "every episode ends with a rollout"
        return tasks, [r for r in rollouts if r is not None]

    async def _start(self, live: _Live) -> bool:
        """Open the episode (again, after a failure) at its first turn; False when it could not be
        opened within its retries (its rollout is then marked infra-failed)."""
        env = self.registry.get(live.plan.env)
        while True:
            try:
                live.episode = await env.start(live.task, live.ctx.child())
            except Exception as failure:  # a session the sandbox could not open, a failing setup...
                live.episode = None
                if self._retry(live, failure):
                    continue
                live.turns = []
                live.rollout = self._rollout(live, None, failure)
                return False
            live.prompt, live.turns = list(live.first_prompt), []
            return True

    def _retry(self, live: _Live, failure: BaseException) -> bool:
        """Whether the episode may run again after `failure` (noted as a retry when it may)."""
        if len(live.retry_reasons) >= self.retry.infra_retries:
            return False
        live.retry_reasons.append(infra_reason(failure).value)
        return True

    def _submit(self, episode: _Live) -> str:
        turn = len(episode.turns)
        seed = (
            episode.plan.sample_seed + episode.sample
            if turn == 0
            else derive_seed("turn", episode.plan.sample_seed, episode.sample, turn)
        )
        tried = len(episode.retry_reasons)
        request_id = f"episode-{episode.plan.sample_seed}-{episode.plan.group}-{episode.sample}-{turn}"
        request_id += f"-retry{tried}" if tried else ""  # the same seeds, but a new request
        self.engine.add_request(request_id, episode.prompt, replace(self.params, n=1, seed=seed))
        return request_id

    async def _advance(self, live: _Live, output: RequestOutput, ready: list[_Live]) -> None:
        """Record the turn, step the environment with the reply, then queue the next turn or finish."""
        (completion,) = output.completions
        assert completion.finish_reason is not None and live.episode is not None
        turn = Turn(
            output.request_id,
            list(output.prompt_token_ids),
            list(completion.token_ids),
            list(completion.logprobs),
            list(completion.versions),
            completion.finish_reason.value,
            output.num_cached_tokens,
        )
        live.turns.append(turn)
        episode = live.episode
        text = str(self.tokenizer.decode(turn.completion_ids, skip_special_tokens=True))
        outcome: Score | BaseException
        try:
            results = await episode.step(self._reply(text, live.task))
            if not episode.done and completion.finish_reason is FinishReason.ABORT:
                episode.done = True
            if not episode.done:
                last = turn.completion_ids[-1]
                observation = self.encoder.encode(results, last, task_tools(live.task))
                live.prompt = turn.prompt_ids + turn.completion_ids + observation
                if len(live.prompt) < self.engine.config.max_model_len:
                    ready.append(live)
                    return
                episode.done = True  # the context is full: the episode ends where it is
            outcome = valid_score(await within_deadline(episode.score(), self.retry.score_timeout_s))
        except Exception as failure:  # one broken environment must not stop the batch
            outcome = failure
        await episode.close()
        if isinstance(outcome, BaseException) and self._retry(live, outcome):
            if await self._start(live):
                ready.append(live)
            return
        live.rollout = self._rollout(live, episode, outcome)

    def _rollout(self, live: _Live, episode: Episode | None, outcome: Score | BaseException) -> Rollout:
        """The episode's rollout: scored, or (`outcome` a failure) infra-failed with its reason."""
        score = outcome if isinstance(outcome, Score) else None
        failure = outcome if isinstance(outcome, BaseException) else None
        no_turn = Trajectory(list(live.first_prompt), [], [], [], [])  # it failed before its first turn
        trajectory = assemble(live.turns) if live.turns else no_turn
        state = episode.state if episode is not None else None
        billed, cached = billed_prompts(live.turns)
        return Rollout(
            env=live.plan.env,
            seed=live.plan.seed,
            group=live.plan.group,
            prompt_ids=trajectory.prompt_ids,
            completion_ids=trajectory.completion_ids,
            logprobs=trajectory.logprobs,
            versions=trajectory.versions,
            finish_reason=live.turns[-1].finish_reason if live.turns else FinishReason.ABORT.value,
            text=state.final_text if state is not None else "",
            reward=score.total if score is not None else 0.0,
            components=dict(score.components) if score is not None else {},
            passed=score.passed if score is not None else False,
            sandbox_time_s=state.ctx.sandbox_time_s if state is not None else 0.0,
            error=describe(failure) if failure is not None else None,
            infra_failure=infra_reason(failure).value if failure is not None else None,
            retry_reasons=list(live.retry_reasons),
            qc_violation=score.qc_violation if score is not None else None,
            sandbox_cpu_s=state.ctx.sandbox_cpu_s if state is not None else 0.0,
            billed_prompt_tokens=billed,
            cached_prompt_tokens=cached,
            loss_mask=trajectory.loss_mask,
            turns=list(live.turns),
            transcript=json.loads(json.dumps(state.messages, default=str)) if state is not None else [],
        )
