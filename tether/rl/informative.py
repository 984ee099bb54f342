"""The informative step of `tether rl bench`: a batch in which every group has mixed rewards.

Early in a run most groups of the bench task score all 0 (or all 1), and tether leaves such groups out
of the learner's forward while TRL computes them, which flatters tether. For a like-for-like step the
bench picks its prompts so that every group is informative: a sample's tokens are fixed by the weights
and its seed (`derive_seed("sample", seed, step, group)`, the engine batch-invariant), so the engine can
*probe* candidate task seeds under each group's sample seed before the run, with the run's model and
sampling settings, and keep for each group the first candidate whose completions score mixed rewards
(`choose_informative`). The chosen prompts are then served in order by `bench/informative_arithmetic`
(`informative_registry`). Whether the timed step really was informative is counted from its own
rollouts (`informative_groups`) and recorded next to the figure, which only counts when all were.
Nothing here knows TRL; the probe is the one part that needs an engine (`engine_probe`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tether.envs.bench import BENCH_ENV, IntegerArithmetic, integer_arithmetic_environment
from tether.envs.context import ScoringContext
from tether.envs.episode import Environment
from tether.envs.registry import EnvRegistry, default_registry
from tether.envs.tasks import Problem, Task
from tether.errors import ConfigError
from tether.rl.rollout import PromptPlan, Rollout, derive_seed, generate_groups, score_groups

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tether.engine.llm_engine import LLMEngine
    from tether.engine.sampling import SamplingParams

INFORMATIVE_ENV = "bench/informative_arithmetic"

# (task seed, sample seed) of each probed group -> the rewards of its completions, in order.
Probe = Callable[[Sequence[tuple[int, int]]], list[list[float]]]


def mixed(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ (some advantage is non-zero): the group is informative."""
    return len(set(rewards)) > 1


def informative_groups(rewards: Sequence[float], group_size: int) -> int:
    """How many of the groups of `rewards` (`group_size` consecutive rewards each) are mixed."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not make whole groups of {group_size}")
    return sum(mixed(rewards[i : i + group_size]) for i in range(0, len(rewards), group_size))


def sample_seeds(seed: int, steps: int, prompts: int) -> list[int]:
    """The sample seed of every group of the first `steps` steps of a run seeded `seed`, step by step
    (what `plan_prompts` gives group g of step s)."""
    return [derive_seed("sample", seed, step, group) for step in range(steps) for group in range(prompts)]


def choose_informative(
    slots: Sequence[int], probe: Probe, candidates: Iterable[int], max_probes: int, per_round: int = 2
) -> list[int]:
    """For each sample seed of `slots`, a distinct task seed from `candidates` (in order) whose group,
    sampled with that seed, has mixed rewards under `probe`. Each round probes about `per_round` x
    len(slots) candidates in one call (one engine batch), shared among the slots still open, so the
    last, hardest slots are searched at the first round's batch size; gives up after `max_probes`
    probed groups with a `ConfigError` naming how many slots it filled."""
    if per_round < 1 or max_probes < 1:
        raise ValueError(f"per_round = {per_round}, max_probes = {max_probes}: expected integers >= 1")
    chosen: dict[int, int] = {}
    source: Iterator[int] = iter(candidates)
    probed = 0
    while len(chosen) < len(slots):
        open_slots = [slot for slot in range(len(slots)) if slot not in chosen]
        each = max(per_round, math.ceil(per_round * len(slots) / len(open_slots)))
        batch = [(task, slot) for slot in open_slots for task in _take(source, each)]
        batch = batch[: max(max_probes - probed, 0)]
        if not batch:
            raise ConfigError(
                f"informative step: {len(chosen)} of {len(slots)} groups found mixed rewards in "
                f"{probed} probed prompts; the model scores (almost) all 0 or all 1 on this task"
            )
        probed += len(batch)
        results = probe([(task, slots[slot]) for task, slot in batch])
        for (task, slot), rewards in zip(batch, results, strict=True):
            if slot not in chosen and mixed(rewards):
                chosen[slot] = task
            # else the candidate is spent: a prompt seen once stays out of the chosen batch
    return [chosen[slot] for slot in range(len(slots))]


def _take(source: Iterator[int], count: int) -> list[int]:
    return [value for _, value in zip(range(count), source, strict=False)]


def engine_probe(engine: LLMEngine, tokenizer: PreTrainedTokenizerBase, params: SamplingParams) -> Probe:
    """A `Probe` that samples each group with `engine` (batch-invariant: a group's tokens do not depend
    on what else is in the batch) and scores it with the bench task's rubric, as a step does."""
    engine.set_batch_invariant(True)
    registry = default_registry()

    def probe(groups: Sequence[tuple[int, int]]) -> list[list[float]]:
        # The group index only names the request: one per probed group, so none collide.
        plans = [PromptPlan(BENCH_ENV, task, index, sample) for index, (task, sample) in enumerate(groups)]
        tasks, rollouts = generate_groups(engine, tokenizer, registry, plans, params)
        asyncio.run(_score(registry, tasks, rollouts))
        rewards: list[list[float]] = [[] for _ in groups]
        for rollout in rollouts:
            rewards[rollout.group].append(rollout.reward)
        return rewards

    return probe


async def _score(registry: EnvRegistry, tasks: Sequence[Task], rollouts: Sequence[Rollout]) -> None:
    ctx = ScoringContext()
    try:
        await score_groups(registry, tasks, rollouts, ctx)  # as a training step scores them
    finally:
        await ctx.aclose()


@dataclass(frozen=True, slots=True)
class ChosenArithmetic:
    """The bench's arithmetic, task i being the problem of task seed `seeds[i]` (the chosen batch)."""

    seeds: tuple[int, ...]

    def problem(self, seed: int) -> Problem:
        if not 0 <= seed < len(self.seeds):
            raise ConfigError(f"informative task {seed}: only {len(self.seeds)} prompts were chosen")
        return IntegerArithmetic().problem(self.seeds[seed])


def informative_registry(seeds: Sequence[int]) -> EnvRegistry:
    """The built-in environments plus `bench/informative_arithmetic`, which serves the chosen prompts
    in order (a run's tasks 0, 1, 2... are `seeds[0]`, `seeds[1]`...), scored as the bench task."""
    registry = default_registry()
    source = ChosenArithmetic(tuple(seeds))

    def environment() -> Environment:
        return replace(integer_arithmetic_environment(), name=INFORMATIVE_ENV, source=source)

    registry.register(INFORMATIVE_ENV, environment, source=__name__)
    return registry
