"""Rollouts: draw prompts from an environment mixture, sample n completions each with the engine, score.

Plan (`plan_prompts`, pure: which environment and task seed each prompt of a step gets, from per-domain
cursors) -> run (`generate_groups`: one engine request per prompt with `SamplingParams(n=...)`, so the n
samples share the prompt's KV blocks) -> score (`score_groups`: every reward component kept;
infrastructure failures retried, then marked rather than scored, `retries.py`). A rollout carries token
ids, the behaviour logprobs and the policy version of every generated token, so the learner never
re-tokenizes and can correct for staleness. Multi-turn episodes are rolled out by
`episodes.py` into the same `Rollout`, with a loss mask over their observation tokens.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tether.chat import ToolSpec, Usage
from tether.chat.template import ChatTemplate
from tether.engine.sampling import SamplingParams
from tether.engine.sequence import FinishReason
from tether.envs.context import ScoringContext
from tether.envs.registry import EnvRegistry, Mixture
from tether.envs.scoring import Score
from tether.envs.tasks import Task
from tether.rl.retries import RetryPolicy, retry_scoring

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tether.engine.llm_engine import LLMEngine


@dataclass(frozen=True, slots=True)
class PromptPlan:
    env: str
    seed: int  # task seed
    group: int  # index of the prompt within its step
    sample_seed: int  # seeds the n samples (sample i uses sample_seed + i)


@dataclass(frozen=True, slots=True)
class Turn:
    """One engine request of an episode and what it returned, as the engine reported it."""

    request_id: str
    prompt_ids: list[int]
    completion_ids: list[int]  # generated, end-of-turn token included when the turn stopped on one
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    cached_tokens: int = 0  # of `prompt_ids`, found in the engine's prefix cache


@dataclass(slots=True)
class Rollout:
    """One completion of one prompt (or one episode), with everything the learner and the metrics need.

    A multi-turn episode's `completion_ids` interleave generated and observation tokens: `loss_mask` says
    which the model generated; observation tokens have logprob 0.0 and version -1.

    `billed_prompt_tokens` are the prompt tokens of the engine requests charged to it, as a gateway bills
    them: a request of n samples reads its prompt once and charges it to its first sample, an episode
    charges every turn's prompt; `cached_prompt_tokens` of them came from the prefix cache (a remote
    server's own count when it reports one, else 0)."""

    env: str
    seed: int
    group: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour logprob of each completion token
    versions: list[int]  # policy version that generated each completion token
    finish_reason: str
    text: str = ""
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    passed: bool = False
    sandbox_time_s: float = 0.0
    sandbox_cpu_s: float = 0.0  # CPU time of its sandbox runs (`ScoringContext.sandbox_cpu_s`)
    billed_prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    error: str | None = None
    # Why it could not be scored, when that was not the model's doing (an `InfraReason` value): such a
    # rollout never enters the advantages. None: scored (the model's own failures are rewards).
    infra_failure: str | None = None
    retry_reasons: list[str] = field(default_factory=list)  # the `InfraReason` that caused each retry
    qc_violation: str | None = None  # the episode broke a rule of its environment (protected files...)
    loss_mask: list[bool] | None = None  # per completion token; None: all generated (single turn)
    turns: list[Turn] = field(default_factory=list)  # multi-turn: every engine request, in order
    transcript: list[dict[str, Any]] = field(default_factory=list)  # multi-turn: the episode's messages

    @property
    def retries(self) -> int:
        """Times it was re-scored or re-generated after an infrastructure failure."""
        return len(self.retry_reasons)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == FinishReason.LENGTH.value

    @property
    def generated(self) -> list[bool]:
        """Per completion token: whether the model generated it."""
        return self.loss_mask if self.loss_mask is not None else [True] * len(self.completion_ids)

    @property
    def generated_versions(self) -> list[int]:
        return [v for v, mine in zip(self.versions, self.generated, strict=True) if mine]

    @property
    def generated_tokens(self) -> int:
        return sum(self.generated)

    @property
    def usage(self) -> Usage:
        """What the gateway would bill for it (`tether.chat.pricing.cost_usd`)."""
        return Usage(self.billed_prompt_tokens, self.cached_prompt_tokens, self.generated_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {
            "env": self.env,
            "seed": self.seed,
            "group": self.group,
            "text": self.text,
            "reward": self.reward,
            "components": self.components,
            "passed": self.passed,
            "finish_reason": self.finish_reason,
            "completion_tokens": self.generated_tokens,
            "policy_versions": sorted(set(self.generated_versions)),
            "error": self.error,
            "infra_failure": self.infra_failure,
            "retries": self.retries,
            "retry_reasons": self.retry_reasons,
            "qc_violation": self.qc_violation,
            "billed_prompt_tokens": self.billed_prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "sandbox_cpu_s": self.sandbox_cpu_s,
            **({"turns": len(self.turns), "transcript": self.transcript} if self.turns else {}),
        }


def billed_prompts(turns: Sequence[Turn]) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of an episode's engine requests: every turn's prompt."""
    return sum(len(turn.prompt_ids) for turn in turns), sum(turn.cached_tokens for turn in turns)


def derive_seed(*parts: object) -> int:
    """A stable 62-bit seed from its parts (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


def plan_prompts(
    mixture: Mixture, cursors: dict[str, int], count: int, seed: int, step: int, seed_offset: int = 0
) -> tuple[list[PromptPlan], dict[str, int]]:
    """The prompts of one step and the advanced cursors; the same inputs always give the same plan.

    Environments are drawn by weight; each domain hands out task seeds seed_offset + 0, 1, 2, ... in
    order, so no training prompt repeats within a domain until its cursor wraps (it does not)."""
    rng = random.Random(derive_seed("plan", seed, step))
    names, weights = mixture.names, [weight for _, weight in mixture.entries]
    advanced = {name: cursors.get(name, 0) for name in names}
    plans = []
    for group in range(count):
        name = rng.choices(names, weights)[0]
        plans.append(
            PromptPlan(name, seed_offset + advanced[name], group, derive_seed("sample", seed, step, group))
        )
        advanced[name] += 1
    return plans, advanced


def task_tools(task: Task) -> tuple[ToolSpec, ...]:
    return tuple(ToolSpec.from_openai(tool) for tool in task.tools)


def encode_prompt(template: ChatTemplate, task: Task) -> list[int]:
    """A task's first prompt as it is served: the model's chat template with the task's tools (natively
    when the template knows tools, else in the Hermes text convention)."""
    return template.encode(task.messages, task_tools(task))


def generate_groups(
    engine: LLMEngine,
    tokenizer: PreTrainedTokenizerBase,
    registry: EnvRegistry,
    plans: Sequence[PromptPlan],
    params: SamplingParams,
) -> tuple[list[Task], list[Rollout]]:
    """Generate n completions per planned prompt in one continuous batch; rollouts are unscored."""
    tasks = []
    for plan in plans:
        env = registry.get(plan.env)
        assert not env.multi_turn, "multi-turn episodes are not rolled out by generate_groups"
        tasks.append(env.task(plan.seed))
    template = ChatTemplate(tokenizer)
    prompts = [encode_prompt(template, task) for task in tasks]
    request_ids = [f"rollout-{plan.sample_seed}-{plan.group}" for plan in plans]
    for request_id, prompt, plan in zip(request_ids, prompts, plans, strict=True):
        engine.add_request(request_id, prompt, replace(params, seed=plan.sample_seed))
    outputs: dict[str, Any] = {}
    pending = set(request_ids)
    while pending:
        for output in engine.step():
            if output.finished and output.request_id in pending:
                outputs[output.request_id] = output
                pending.discard(output.request_id)
    rollouts = []
    for request_id, plan in zip(request_ids, plans, strict=True):
        output = outputs[request_id]
        for sample, completion in enumerate(output.completions):
            assert completion.finish_reason is not None
            first = sample == 0  # the request read its prompt once: its first sample is billed for it
            rollouts.append(
                Rollout(
                    env=plan.env,
                    seed=plan.seed,
                    group=plan.group,
                    prompt_ids=list(output.prompt_token_ids),
                    completion_ids=list(completion.token_ids),
                    logprobs=list(completion.logprobs),
                    versions=list(completion.versions),
                    finish_reason=completion.finish_reason.value,
                    text=str(tokenizer.decode(completion.token_ids, skip_special_tokens=True)),
                    billed_prompt_tokens=len(output.prompt_token_ids) if first else 0,
                    cached_prompt_tokens=output.num_cached_tokens if first else 0,
                )
            )
    return tasks, rollouts


async def score_groups(
    registry: EnvRegistry,
    tasks: Sequence[Task],
    rollouts: Sequence[Rollout],
    ctx: ScoringContext,
    policy: RetryPolicy = RetryPolicy(),
) -> None:
    """Score every rollout in place, concurrently. A scoring that fails for a reason not the model's
    (`retries.py`) is tried again under `policy`, then marks the rollout infra-failed with its reason."""
    by_group = {task_index: task for task_index, task in enumerate(tasks)}

    async def one(rollout: Rollout) -> None:
        task = by_group[rollout.group]
        children: list[ScoringContext] = []

        def attempt() -> Awaitable[Score]:
            children.append(ctx.child())
            return registry.get(rollout.env).score(task, rollout.text, children[-1])

        attempts = await retry_scoring(attempt, policy)
        attempts.apply(rollout)
        rollout.sandbox_time_s = sum(child.sandbox_time_s for child in children)  # every try's time
        rollout.sandbox_cpu_s = sum(child.sandbox_cpu_s for child in children)

    await asyncio.gather(*(one(rollout) for rollout in rollouts))
