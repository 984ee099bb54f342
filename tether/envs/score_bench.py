"""Scoring throughput of code answers: N answers, right and wrong, scored through one sandbox pool.

The mix is HumanEval (canonical and mutated solutions) and generated Python families (reference and
mutant solutions), scored by the environments' own `score`, so parsing, the harness and the rubric
are all in the measured path; task generation is not. Every score is checked against what it must
be (1.0 or 0.0), so a fast but wrong scorer fails the benchmark instead of winning it. C and C++
answers are left out by default: their compiler dominates (about 0.3 s of CPU per answer).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

import typer

from tether.envs.code.envs import FAMILIES, family_env, humaneval_env
from tether.envs.code.families import Lang
from tether.envs.code.humaneval import problem_by_id
from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.episode import Environment
from tether.envs.errors import EnvError
from tether.envs.tasks import Task
from tether.machine import load_average, machine_record, warn_if_busy
from tether.sandbox.pool import PoolConfig, SandboxUnavailable
from tether.sandbox.spec import SandboxSpec


@dataclass(frozen=True, slots=True)
class BenchConfig:
    answers: int = 1000  # answers scored per repeat
    repeats: int = 3  # the figure is the median over repeats
    concurrency: int = 8  # answers in flight at once (the pool queues beyond its slots)
    slots: int | None = None  # sandbox workers; None: one per CPU core
    seed: int = 0  # which tasks and which half of them are answered wrongly
    native: bool = False  # include C and C++ families (compile-bound)

    def __post_init__(self) -> None:
        for name in ("answers", "repeats", "concurrency"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise EnvError(f"bench {name} = {value!r}: must be a positive integer")
        if self.slots is not None and not 1 <= self.slots <= 1024:
            raise EnvError(f"bench slots = {self.slots!r}: must be between 1 and 1024")


@dataclass(frozen=True, slots=True)
class BenchAnswer:
    env: Environment
    task: Task
    completion: str
    correct: bool


@dataclass(frozen=True, slots=True)
class BenchResult:
    answers: int
    repeats: int
    concurrency: int
    slots: int
    answers_per_s: float  # median over repeats
    per_repeat_answers_per_s: list[float]
    mismatches: int  # scores that were not 1.0 for a right answer or 0.0 for a wrong one, over all repeats
    # Trivial `print(1)` runs per second through the same pool, measured between repeats: on a shared
    # machine the ratio of the two figures says more than either alone.
    baseline_runs_per_s: float = 0.0
    mix: dict[str, int] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    """`tether.machine.machine_record`; threads: the sandbox workers."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_answers(count: int, seed: int = 0, native: bool = False) -> list[BenchAnswer]:
    """`count` answers cycling over HumanEval and the families, alternately right and wrong."""
    envs = [humaneval_env()] + [family_env(f) for f in FAMILIES if native or f.language is Lang.PYTHON]
    answers = []
    for index in range(count):
        env = envs[index % len(envs)]
        task = env.task(seed + index)
        correct = (index // len(envs)) % 2 == 0
        if correct:
            completion = env.parser.format(task.reference)
        elif env.name == "code/humaneval":
            stub = problem_by_id(str(task.data["task_id"])).prompt + "    return None\n"
            completion = env.parser.format(stub)
        else:
            family = next(f for f in FAMILIES if f"code/{f.name}" == env.name)
            completion = env.parser.format(family.task(task.seed).mutant)
        answers.append(BenchAnswer(env, task, completion, correct))
    return answers


async def score_all(answers: list[BenchAnswer], ctx: ScoringContext, concurrency: int) -> tuple[float, int]:
    """Score every answer; returns the wall time and how many scores were not what they must be."""
    gate = asyncio.Semaphore(concurrency)

    async def one(answer: BenchAnswer) -> bool:
        async with gate:
            score = await answer.env.score(answer.task, answer.completion, ctx.child())
        return score.total == (1.0 if answer.correct else 0.0)

    started = time.perf_counter()
    matches = await asyncio.gather(*(one(answer) for answer in answers))
    return time.perf_counter() - started, matches.count(False)


async def trivial_rate(ctx: ScoringContext, count: int, concurrency: int) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            await ctx.run("print(1)")

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    return count / (time.perf_counter() - started)


async def run_bench(config: BenchConfig, spec: SandboxSpec | None = None) -> BenchResult:
    load_start = load_average()
    answers = build_answers(config.answers, config.seed, config.native)
    pool_config = PoolConfig() if config.slots is None else PoolConfig(slots=config.slots)
    rates, baselines, mismatches = [], [], 0
    async with SandboxProvider(spec or SandboxSpec(timeout_s=10, memory_mib=256), pool_config) as sandbox:
        ctx = ScoringContext(sandbox)
        await ctx.pool()  # start the workers outside the timed region
        for _ in range(config.repeats):
            wall_s, wrong = await score_all(answers, ctx, config.concurrency)
            rates.append(round(len(answers) / wall_s, 1))
            mismatches += wrong
            baselines.append(await trivial_rate(ctx, min(config.answers, 300), config.concurrency))
    return BenchResult(
        answers=config.answers,
        repeats=config.repeats,
        concurrency=config.concurrency,
        slots=pool_config.slots,
        answers_per_s=statistics.median(rates),
        per_repeat_answers_per_s=rates,
        mismatches=mismatches,
        baseline_runs_per_s=round(statistics.median(baselines), 1),
        mix=dict(Counter(answer.env.name for answer in answers)),
        machine=machine_record(pool_config.slots, load_start),
    )


def bench(config: BenchConfig | None = None) -> BenchResult:
    """Blocking entry point for the command line (`tether envs bench`)."""
    return asyncio.run(run_bench(config or BenchConfig()))


def bench_command(
    answers: Annotated[int, typer.Option("--answers", min=1, help="Answers scored per repeat.")] = 1000,
    repeats: Annotated[
        int, typer.Option("--repeats", min=1, help="Repeats; the figure is their median.")
    ] = 3,
    concurrency: Annotated[int, typer.Option("--concurrency", min=1, help="Answers in flight at once.")] = 8,
    slots: Annotated[
        int | None, typer.Option("--slots", min=1, help="Sandbox workers (default: CPUs).")
    ] = None,
    native: Annotated[bool, typer.Option("--native", help="Include the C and C++ families.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Scoring throughput: code answers, right and wrong, through one sandbox pool (answers/s, median)."""
    try:
        result = bench(BenchConfig(answers, repeats, concurrency, slots, native=native))
    except (EnvError, SandboxUnavailable) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    warn_if_busy(result.machine)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        typer.echo(
            f"{result.answers_per_s:.1f} answers/s (median of {result.per_repeat_answers_per_s}), "
            f"{result.answers} answers x {result.repeats}, {result.slots} slots, "
            f"{result.mismatches} mismatches; trivial runs: {result.baseline_runs_per_s:.1f}/s"
        )
    if result.mismatches:
        raise typer.Exit(1)  # a scorer that gets answers wrong has no throughput worth reporting
