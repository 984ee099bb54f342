"""Every registered environment: reference solutions score 1.0 and wrong or adversarial answers score 0.

One parametrized test over the whole registry (built-ins and plug-ins), so a new domain is covered the
moment it registers. Each task is played as an episode (reference replies may use tools), so
multi-turn and sandbox-scored domains run through the same path as the trainer's.

The default run covers seeds 0, 1, 2, ... until 20 are done or the environment has used its time
budget (always at least one seed): a few generators take about a second per task. `-m slow` runs all 20 seeds
of every environment.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tether.chat import Messages
from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.episode import Environment, run_episode, scripted_policy
from tether.envs.registry import default_registry
from tether.envs.scoring import Score
from tether.envs.tasks import MAX_SEED, Task
from tether.sandbox.pool import PoolConfig

REGISTRY = default_registry()
NAMES = REGISTRY.names()
SEEDS = 20
MIN_SEEDS = 1
BUDGET_S = 0.5
FULL_WRONG_SEEDS = 1  # every wrong and adversarial answer on the first seed; one made-up answer after


@pytest_asyncio.fixture
async def ctx() -> AsyncIterator[ScoringContext]:
    """A sandbox pool that starts only if the environment executes something."""
    async with SandboxProvider(config=PoolConfig(slots=2)) as provider:
        yield ScoringContext(provider)


async def play(env: Environment, task: Task, replies: Messages, ctx: ScoringContext) -> Score:
    result = await run_episode(env, task, scripted_policy(replies), ctx.child())
    return result.score


async def check(env: Environment, seed: int, ctx: ScoringContext) -> None:
    task = env.task(seed)
    assert task == env.task(seed), "the same seed must give the same task"
    json.dumps(task.to_dict())
    reference = await play(env, task, env.reference(task), ctx)
    assert reference.total == 1.0 and reference.passed, (seed, task.reference, reference.components)
    wrong = env.wrong_answers(task)
    for completion in wrong if seed < FULL_WRONG_SEEDS else wrong[3:4]:
        score = await play(env, task, [{"role": "assistant", "content": completion}], ctx)
        assert score.total == 0.0 and not score.passed, (seed, completion, score.components)


@pytest.mark.parametrize("name", NAMES)
async def test_reference_scores_one_and_wrong_answers_zero(name: str, ctx: ScoringContext) -> None:
    env = REGISTRY.get(name)
    start = time.monotonic()
    for seed in range(SEEDS):
        if seed >= MIN_SEEDS and time.monotonic() - start > BUDGET_S:
            break
        await check(env, seed, ctx)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
async def test_reference_scores_one_and_wrong_answers_zero_on_all_seeds(
    name: str, ctx: ScoringContext
) -> None:
    env = REGISTRY.get(name)
    for seed in range(SEEDS):
        await check(env, seed, ctx)


def test_the_registry_spans_at_least_100_environments_in_8_families() -> None:
    # The acceptance bar for `tether envs list`.
    assert len(NAMES) >= 100
    assert len(REGISTRY.families()) >= 8


def test_every_environment_builds_a_task_from_the_largest_seed() -> None:
    # The trainer draws seeds from the whole range (Mixture.sample); no generator may choke on them.
    for name in NAMES:
        task = REGISTRY.get(name).task(MAX_SEED)
        assert task.seed == MAX_SEED and task.messages, name
