"""No task rewards doing nothing: in every registered environment an empty reply, an evasive one and,
where the environment offers a tool that ends the episode (`submit`), an immediate call to it score 0
and do not pass, on seeds 0..199 and on every seed that once drew a task already solved.

Task generation dominates the cost: 200 seeds of every sandbox-free environment took 9 minutes on two
busy cores, 95% of it in fifteen reasoning-gym generators (knight_swap about 0.65 s a task, one seed of
number_sequence 25 s of CPU), and a sandboxed episode takes 0.1-0.4 s. So the default run plays seeds
0, 1, 2, ... of each environment until its time budget is used (always at least `MIN_SEEDS`, or
`MIN_SANDBOXED_SEEDS` in a sandbox session), which covers all 200 seeds of the cheap generators, plus
the known-bad seeds; a seed that alone takes tens of seconds to generate waits for `-m slow`. In a
sandboxed environment each seed plays one of the answers in turn: all of them leave the fixtures
untouched, and that state is what such an environment scores. `-m slow` plays every answer on all 200
seeds of every environment.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tether.chat import Message
from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.episode import Environment, run_episode, scripted_policy
from tether.envs.registry import default_registry
from tether.envs.shell import tool_call_message
from tether.sandbox.pool import PoolConfig

REGISTRY = default_registry()
NAMES = REGISTRY.names()
SEEDS = 200
MIN_SEEDS = 2
MIN_SANDBOXED_SEEDS = 20  # the domains whose fixtures can come out solved (shell/replace did)
BUDGET_S = 1.0
SLOTS = 2  # sandboxed episodes played at once, one per pool slot
# Seeds that drew a task solved before any action, before generators re-drew such tasks.
KNOWN_BAD = {"shell/replace": (31, 131, 93105)}
# Seeds whose generation alone takes tens of seconds, left to `-m slow` (rg/number_sequence 163: about
# 25 s of CPU in reasoning-gym's generator).
SLOW_SEEDS = {"rg/number_sequence": (163,)}


pytestmark = pytest.mark.asyncio(loop_scope="module")  # the loop that holds the module's pool


# One pool for the module, started only when an environment executes something.
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ctx() -> AsyncIterator[ScoringContext]:
    async with SandboxProvider(config=PoolConfig(slots=SLOTS)) as provider:
        yield ScoringContext(provider)


def do_nothing_answers(env: Environment) -> list[Message]:
    """Replies that do no work: silence, a shrug, and ending the episode at once with empty arguments."""
    answers: list[Message] = [
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": "I am not sure."},
    ]
    for tool in env.tools:
        if tool.ends:
            arguments = {name: "" for name in tool.spec.parameters.get("required", [])}
            answers.append(tool_call_message(tool.name, arguments, 0))
    return answers


async def check_seed(env: Environment, seed: int, answers: list[Message], ctx: ScoringContext) -> None:
    task = env.task(seed)
    for answer in answers:
        result = await run_episode(env, task, scripted_policy([answer]), ctx.child())
        assert result.score.total == 0.0 and not result.score.passed, (
            env.name,
            seed,
            answer,
            result.score.components,
        )


async def check_seeds(env: Environment, seeds: list[int], ctx: ScoringContext, every_answer: bool) -> None:
    """Sandbox-free environments play every answer in turn; sandboxed ones `SLOTS` seeds at a time."""
    answers = do_nothing_answers(env)
    if not env.needs_session:
        for seed in seeds:
            await check_seed(env, seed, answers, ctx)
        return
    for start in range(0, len(seeds), SLOTS):
        batch = seeds[start : start + SLOTS]
        await asyncio.gather(
            *(
                check_seed(env, seed, answers if every_answer else [answers[seed % len(answers)]], ctx)
                for seed in batch
            )
        )


@pytest.mark.parametrize("name", NAMES)
async def test_doing_nothing_scores_zero(name: str, ctx: ScoringContext) -> None:
    env = REGISTRY.get(name)
    await check_seeds(env, list(KNOWN_BAD.get(name, ())), ctx, every_answer=True)
    seeds = [seed for seed in range(SEEDS) if seed not in SLOW_SEEDS.get(name, ())]
    least = MIN_SANDBOXED_SEEDS if env.needs_session else MIN_SEEDS
    start = time.monotonic()
    for first in range(0, len(seeds), SLOTS):
        if first >= least and time.monotonic() - start > BUDGET_S:
            break
        await check_seeds(env, seeds[first : first + SLOTS], ctx, every_answer=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
async def test_doing_nothing_scores_zero_on_all_seeds(name: str, ctx: ScoringContext) -> None:
    env = REGISTRY.get(name)
    await check_seeds(env, [*KNOWN_BAD.get(name, ()), *range(SEEDS)], ctx, every_answer=True)
