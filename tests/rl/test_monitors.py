"""Reward-hacking monitors: they fire on a domain built to be gamed (answer tags stuffed, reward that grows
with length, rule breaking, a judge that sees through it), stay quiet on the demo's domains scored for
real, and reach `warnings.jsonl`, the step's metrics and `report.html` through the trainer."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.episode import Environment
from tether.envs.exploits import tag_stuffing
from tether.envs.registry import EnvRegistry, default_registry
from tether.envs.scoring import EpisodeState, Reward, RewardInput, Rubric
from tether.envs.tasks import ChatRenderer, Parsed, Problem, Task
from tether.errors import ConfigError
from tether.models import load
from tether.rl.builders import learner_options, open_run
from tether.rl.config import parse_config
from tether.rl.learner import Learner
from tether.rl.monitors import (
    WARNINGS,
    WARNINGS_FILE,
    domain_monitors,
    monitor_metrics,
    over_thresholds,
    pearson,
)
from tether.rl.report import read_jsonl
from tether.rl.report_sections import Monitor, MonitorsSection
from tether.rl.rollout import PromptPlan, Rollout, score_groups
from tether.rl.sources import Generated
from tether.rl.trainer import Trainer
from tether.sandbox.pool import PoolConfig

from .test_trainer import tiny_config

HACK = "hack/stuffing"
DEMO_DOMAINS = ("math/python_arithmetic", "bench/integer_arithmetic", "rg/leg_counting")


@dataclass(frozen=True, slots=True)
class _Digit:
    def problem(self, seed: int) -> Problem:
        return Problem(prompt=f"Which digit is {seed % 10}?", answer=str(seed % 10))


@dataclass(frozen=True, slots=True)
class _LenientTags:
    """Takes every <answer> block: a checker that accepts any of them can be gamed by listing all."""

    instructions: str = "Answer between <answer> tags."

    def parse(self, completion: str) -> Parsed:
        blocks = re.findall(r"<answer>(.*?)</answer>", completion, re.DOTALL)
        return Parsed("|".join(blocks) if blocks else None, bool(blocks))

    def format(self, answer: str) -> str:
        return f"<answer>{answer}</answer>"


def _any_block_right(inp: RewardInput) -> float:
    return 1.0 if inp.parsed.answer and inp.task.reference in inp.parsed.answer.split("|") else 0.0


def _longer_is_better(inp: RewardInput) -> float:
    return min(1.0, len(inp.completion) / 300)


def _judge_sees_through_stuffing(inp: RewardInput) -> float:
    return 1.0 if inp.completion.count("<answer>") == 1 and _any_block_right(inp) else 0.0


async def _no_deleting(state: EpisodeState) -> str | None:
    return "deleted protected files" if "rm -rf" in state.final_text else None


def hackable_environment() -> Environment:
    """Every hole at once: a lenient parser, a length reward, a rule to break and a judge beside them."""
    return Environment(
        name=HACK,
        source=_Digit(),
        renderer=ChatRenderer("Answer."),
        parser=_LenientTags(),
        rubric=Rubric(
            (
                Reward("correct", _any_block_right),
                Reward("length", _longer_is_better),
                Reward("judge", _judge_sees_through_stuffing, weight=0.0),
            )
        ),
        validators=(_no_deleting,),
        exploits=(tag_stuffing(),),
    )


def _rollout(env: str, seed: int, group: int, text: str) -> Rollout:
    tokens = len(text) // 4 + 1  # a stand-in for the tokenizer: longer text, more tokens
    return Rollout(env, seed, group, [1, 2], [3] * tokens, [-0.5] * tokens, [0] * tokens, "stop", text=text)


async def _scored(
    registry: EnvRegistry, completions: Sequence[tuple[str, int, str]], ctx: ScoringContext
) -> tuple[list[Task], list[Rollout]]:
    """(env, seed, completion) scored by the trainer's own `score_groups`, one group each."""
    tasks = [registry.get(env).task(seed) for env, seed, _ in completions]
    rollouts = [_rollout(env, seed, i, text) for i, (env, seed, text) in enumerate(completions)]
    await score_groups(registry, tasks, rollouts, ctx)
    return tasks, rollouts


def _exploits(registry: EnvRegistry, tasks: Sequence[Task]) -> Callable[[Rollout], list[str]]:
    return lambda r: registry.get(r.env).exploits_in(tasks[r.group], r.text)


def _hacked_step(seeds: Sequence[int] = range(16)) -> list[tuple[str, int, str]]:
    """16 answers: 4 honest, 4 wrong, 6 stuffed with every digit and padding, 2 breaking a rule."""
    stuffed = "".join(f"<answer>{d}</answer>" for d in range(10)) + " padding" * 40
    texts = [f"<answer>{seed % 10}</answer>" for seed in seeds[:4]] + ["<answer>x</answer>"] * 4
    texts += [stuffed] * 6 + ["rm -rf / <answer>1</answer>"] * 2
    return [(HACK, seed, text) for seed, text in zip(seeds, texts, strict=True)]


def hack_registry() -> EnvRegistry:
    registry = EnvRegistry()
    registry.add(hackable_environment())
    return registry


async def test_every_monitor_fires_on_a_domain_built_to_be_gamed() -> None:
    registry = hack_registry()
    tasks, rollouts = await _scored(registry, _hacked_step(), ScoringContext())
    assert [r.qc_violation for r in rollouts[-2:]] == ["deleted protected files"] * 2  # from Score
    section = MonitorsSection()
    values = domain_monitors(rollouts, _exploits(registry, tasks), section)
    # 6 stuffed answers earn 6 x 1.0; 4 honest ones 4 x 0.5 (+ a little length): most reward is stuffing.
    assert values[Monitor.EXPLOIT_REWARD_SHARE] > 0.7
    assert values[Monitor.QC_VIOLATION_RATE] == pytest.approx(2 / 16)
    assert values[Monitor.REWARD_LENGTH_CORRELATION] > 0.7
    assert values[Monitor.JUDGE_DISAGREEMENT] == pytest.approx(6 / 16)  # the stuffed answers
    metrics = monitor_metrics(rollouts, _exploits(registry, tasks), section)
    fired = {(w.domain, w.monitor) for w in over_thresholds(metrics, section)}
    assert fired == {(HACK, monitor) for monitor in Monitor}
    # Raised thresholds silence them.
    lenient = MonitorsSection(
        qc_violation_rate=1, exploit_reward_share=1, reward_length_correlation=1, judge_disagreement=1
    )
    assert over_thresholds(metrics, lenient) == []


@pytest_asyncio.fixture
async def sandboxed() -> AsyncIterator[ScoringContext]:
    async with SandboxProvider(config=PoolConfig(slots=2)) as provider:
        yield ScoringContext(provider)


async def test_the_demo_domains_stay_quiet_on_their_references_and_typical_wrong_answers(
    sandboxed: ScoringContext,
) -> None:
    registry = default_registry()
    completions = []
    for env in DEMO_DOMAINS:
        for seed in range(4):
            task = registry.get(env).task(seed)
            reference = registry.get(env).reference(task)[-1]["content"]
            completions += [(env, seed, str(reference))]
            completions += [(env, seed, wrong) for wrong in registry.get(env).wrong_answers(task)]
    tasks, rollouts = await _scored(registry, completions, sandboxed)
    assert sum(r.passed for r in rollouts) == 4 * len(DEMO_DOMAINS)  # the references, and only them
    metrics = monitor_metrics(rollouts, _exploits(registry, tasks), MonitorsSection())
    assert {key.split("/")[1] + "/" + key.split("/")[2] for key in metrics} == set(DEMO_DOMAINS)
    assert over_thresholds(metrics, MonitorsSection()) == []
    assert rollouts[0].sandbox_cpu_s > 0  # python_arithmetic's reference program ran in the sandbox


def test_pearson_is_zero_when_a_side_is_constant_and_one_for_a_line() -> None:
    assert pearson([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]) == pytest.approx(1.0)
    assert pearson([1.0, 1.0, 1.0], [2.0, 4.0, 6.0]) == 0.0


def test_correlation_waits_for_enough_rollouts_and_infra_failures_are_left_out() -> None:
    rollouts = [_rollout("a/x", 0, 0, "x" * (4 * n)) for n in range(6)]
    for n, rollout in enumerate(rollouts):
        rollout.reward = n / 5
    values = domain_monitors(rollouts, lambda r: [], MonitorsSection(correlation_min_rollouts=6))
    assert values[Monitor.REWARD_LENGTH_CORRELATION] == pytest.approx(1.0)
    rollouts[0].infra_failure = "sandbox_error"
    rollouts[0].qc_violation = "never counted"
    values = domain_monitors(rollouts, lambda r: [], MonitorsSection(correlation_min_rollouts=6))
    assert Monitor.REWARD_LENGTH_CORRELATION not in values and values[Monitor.QC_VIOLATION_RATE] == 0.0
    assert Monitor.JUDGE_DISAGREEMENT not in values  # no judge in this domain


@pytest.mark.parametrize(
    ("monitors", "message"),
    [
        ({"qc_violation_rate": 1.5}, "monitors.qc_violation_rate = 1.5"),
        ({"reward_length_correlation": -2}, "monitors.reward_length_correlation = -2"),
        ({"correlation_min_rollouts": 2}, "monitors.correlation_min_rollouts = 2"),
        ({"length": 0.5}, "unknown key 'monitors.length'"),
    ],
)
def test_bad_monitor_thresholds_are_refused_naming_the_key(monitors: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"envs": {"weights": {"math/arithmetic": 1.0}}, "monitors": monitors})


class _ScriptedSource:
    """A rollout source that answers the planned prompts with the hacked step, scored for real."""

    def __init__(self, registry: EnvRegistry) -> None:
        self.registry = registry

    def generate(self, plans: Sequence[PromptPlan]) -> Generated:
        completions = _hacked_step([plan.seed for plan in plans])
        tasks, rollouts = asyncio.run(_scored(self.registry, completions, ScoringContext()))
        return Generated(tasks, rollouts, 0.1, 0.1)

    def load(self, weights: Any, version: int) -> None:
        return None

    def close(self) -> None:
        return None


def test_the_trainer_records_warnings_and_the_report_lists_them(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    config = tiny_config(
        tiny_model("llama"),
        tmp_path,
        envs={"weights": {HACK: 1.0}},
        rollout={"prompts_per_step": 16, "samples_per_prompt": 1, "max_new_tokens": 8},
        optim={"lr": 1e-3, "micro_batch": 16},
        run={"steps": 1, "checkpoint_every": 1},
    )
    torch.manual_seed(0)
    model, _, _ = load(config.model.name)
    registry = hack_registry()
    learner = Learner(model, **learner_options(config))
    trainer = Trainer(
        config, None, None, learner, registry, ScoringContext(), rollouts=_ScriptedSource(registry)
    )
    open_run(trainer, resume=False)
    [metrics] = trainer.run()
    trainer.close()
    run_dir = tmp_path / "tiny"
    warnings = read_jsonl(run_dir / WARNINGS_FILE)
    assert metrics[WARNINGS] == len(warnings) >= 3
    assert {row["monitor"] for row in warnings} >= {"exploit_reward_share", "reward_length_correlation"}
    assert all(row["step"] == 1 and row["domain"] == HACK for row in warnings)
    page = (run_dir / "report.html").read_text()
    assert '<table id="warnings">' in page and "exploit_reward_share" in page
    assert json.loads((run_dir / "cost.json").read_text())["steps"] == 1
