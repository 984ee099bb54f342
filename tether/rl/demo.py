"""`tether demo`'s job: a short RL run, evaluated on held-out task seeds before and after training.

Plan the held-out prompts (task seeds outside the training range) -> evaluate with the trainer's own
rollout engine -> train -> evaluate again with the trained weights -> compare per domain. Both
evaluations use the same tasks and sampling seeds, so the comparison is paired and the noise it reports
(the standard error of the paired difference over prompts) is the evaluation's own sampling noise. The
trainer writes the run directory (metrics, transcripts); this module adds `report.html` and leaves
printing and `demo.json` to the caller. In-process (local) backend only.
"""

from __future__ import annotations

import math
import statistics
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from rich.table import Table

from tether.engine.sampling import SamplingParams
from tether.envs.context import SandboxProvider
from tether.envs.registry import EnvRegistry
from tether.errors import ConfigError
from tether.rl.builders import build_trainer
from tether.rl.config import TrainConfig, parse_config
from tether.rl.report import ALL, write_report  # ALL: the comparison row over every domain
from tether.rl.rollout import PromptPlan, Rollout, derive_seed
from tether.rl.sections import Backend, RolloutBackend
from tether.rl.sources import EngineRollouts
from tether.rl.trainer import Metrics

Z_CLEAR = 2.0  # a gain counts as clear when it exceeds this many standard errors


class DemoSection(BaseModel):
    """`[demo]`: the held-out evaluation around the training run, and the sandbox check before it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts_per_domain: int = Field(
        16, ge=2, description="Held-out prompts per domain (at least 2, for a standard error)."
    )
    samples_per_prompt: int = Field(4, ge=1, le=64, description="Completions sampled per held-out prompt.")
    temperature: float | None = Field(
        None,
        ge=0,
        le=10,
        description="Evaluation sampling temperature, 0: greedy (unset: rollout.temperature).",
    )
    max_new_tokens: int | None = Field(
        None, ge=1, description="Longest evaluation completion, tokens (unset: rollout.max_new_tokens)."
    )
    seed_offset: int = Field(
        1_000_000,
        ge=0,
        description="Held-out task seeds are seed_offset + 0, 1, ...; they must miss every training seed.",
    )
    seed: int = Field(0, ge=0, description="Seeds the evaluation's sampling (the same before and after).")
    humaneval: bool = Field(True, description="Check the sandbox with HumanEval's solutions first.")

    @model_validator(mode="after")
    def _sampled(self) -> DemoSection:
        if self.temperature == 0 and self.samples_per_prompt > 1:
            raise ValueError(
                f"demo.samples_per_prompt = {self.samples_per_prompt} with demo.temperature = 0: greedy "
                "samples are identical; use 1 sample or a temperature > 0"
            )
        return self


@dataclass(frozen=True, slots=True)
class DemoConfig:
    demo: DemoSection
    train: TrainConfig

    def __post_init__(self) -> None:
        if self.train.run.backend is not Backend.LOCAL:
            raise ConfigError(
                f"run.backend = {self.train.run.backend.value!r}: the demo evaluates with the in-process "
                "rollout engine; use 'local'"
            )
        if self.train.rollout_backend is not RolloutBackend.LOCAL:
            raise ConfigError(
                f"rollout.backend = {self.train.rollout_backend.value!r}: the demo evaluates with the "
                "in-process rollout engine; use 'local'"
            )
        train_seeds = training_seed_range(self.train)
        held_out = range(self.demo.seed_offset, self.demo.seed_offset + self.demo.prompts_per_domain)
        if held_out.start < train_seeds.stop and train_seeds.start < held_out.stop:
            raise ConfigError(
                f"demo.seed_offset = {self.demo.seed_offset}: held-out seeds {held_out.start}.."
                f"{held_out.stop - 1} overlap the training seeds {train_seeds.start}..{train_seeds.stop - 1} "
                f"(envs.seed_offset + run.steps x rollout.prompts_per_step); use a demo.seed_offset of at "
                f"least {train_seeds.stop}"
            )

    @property
    def eval_max_new_tokens(self) -> int:
        return self.demo.max_new_tokens or self.train.rollout.max_new_tokens

    @property
    def eval_temperature(self) -> float:
        """The training temperature unless set: the evaluation then measures the policy that was trained."""
        return self.train.rollout.temperature if self.demo.temperature is None else self.demo.temperature

    def with_run(self, **updates: Any) -> DemoConfig:
        """The same demo with `run` fields replaced (a fresh run name, another output folder)."""
        run = self.train.run.model_copy(update=updates)
        return DemoConfig(self.demo, self.train.model_copy(update={"run": run}))

    def with_model(self, **updates: Any) -> DemoConfig:
        model = self.train.model.model_copy(update=updates)
        return DemoConfig(self.demo, self.train.model_copy(update={"model": model}))


def training_seed_range(config: TrainConfig) -> range:
    """Every task seed training can draw: each domain's cursor advances at most once per prompt."""
    start = config.envs.seed_offset
    return range(start, start + config.run.steps * config.rollout.prompts_per_step)


def parse_demo_config(raw: dict[str, Any], source: str = "demo config") -> DemoConfig:
    """`[demo]` (optional: defaults) as a `DemoSection`; every other section is a `TrainConfig`."""
    rest = dict(raw)
    section = rest.pop("demo", {})
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: demo = {section!r}: expected a [demo] table")
    try:
        demo = DemoSection.model_validate(section)
    except ValidationError as error:
        problems = []
        for problem in error.errors():
            key = ".".join(["demo", *(str(part) for part in problem["loc"])])
            if problem["type"] == "extra_forbidden":
                known = ", ".join(sorted(DemoSection.model_fields))
                problems.append(f"{source}: unknown key {key!r}; known keys: {known}")
            elif problem["type"] == "value_error":
                problems.append(f"{source}: {problem['msg'].removeprefix('Value error, ')}")
            else:
                problems.append(f"{source}: {key} = {problem['input']!r}: {problem['msg']}")
        raise ConfigError("\n".join(problems)) from None
    return DemoConfig(demo, parse_config(rest, source))


def load_demo_config(path: Path) -> DemoConfig:
    if not path.is_file():
        raise ConfigError(f"demo config {str(path)!r} does not exist (the default is configs/demo.toml)")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"demo config {str(path)!r} is not valid TOML: {error}") from None
    return parse_demo_config(raw, str(path))


# --- evaluation -----------------------------------------------------------------------------------------


def eval_plans(domains: Sequence[str], section: DemoSection) -> list[PromptPlan]:
    """The held-out prompts: `prompts_per_domain` task seeds from `seed_offset` in every domain."""
    plans: list[PromptPlan] = []
    for env in domains:
        for index in range(section.prompts_per_domain):
            seed = section.seed_offset + index
            plans.append(PromptPlan(env, seed, len(plans), derive_seed("eval", section.seed, env, seed)))
    return plans


def evaluate(source: EngineRollouts, plans: Sequence[PromptPlan], params: SamplingParams) -> list[Rollout]:
    """Generate and score `plans` with the weights the engine holds now; training is left as it was."""
    training_params = source.params
    source.params = params
    try:
        return source.generate(plans).rollouts
    finally:
        source.params = training_params


@dataclass(frozen=True, slots=True)
class Comparison:
    """Held-out reward of one domain (or of all) before and after training, paired by prompt."""

    env: str
    prompts: int
    samples: int  # per prompt
    before: float  # mean reward
    after: float
    before_pass: float  # share of samples that passed
    after_pass: float
    stderr: float  # standard error of after - before (paired by prompt)

    @property
    def delta(self) -> float:
        return self.after - self.before

    @property
    def clear(self) -> bool:
        """The gain exceeds Z_CLEAR standard errors of the evaluation's own noise."""
        return self.delta > Z_CLEAR * self.stderr

    def to_dict(self) -> dict[str, Any]:
        return {
            "env": self.env,
            "prompts": self.prompts,
            "samples_per_prompt": self.samples,
            "reward_before": self.before,
            "reward_after": self.after,
            "delta": self.delta,
            "stderr": self.stderr,
            "noise": Z_CLEAR * self.stderr,  # a gain above this is clear
            "pass_before": self.before_pass,
            "pass_after": self.after_pass,
            "clear": self.clear,
        }


PromptKey = tuple[str, int]  # (environment, task seed)
ByPrompt = dict[PromptKey, list[Rollout]]


def _by_prompt(rollouts: Sequence[Rollout]) -> ByPrompt:
    groups: ByPrompt = {}
    for rollout in rollouts:
        groups.setdefault((rollout.env, rollout.seed), []).append(rollout)
    return groups


def _reward(rollout: Rollout) -> float:
    return rollout.reward


def _passed(rollout: Rollout) -> float:
    return float(rollout.passed)


def _mean(rollouts: Sequence[Rollout], value: Callable[[Rollout], float]) -> float:
    return sum(value(rollout) for rollout in rollouts) / len(rollouts)


def _compare(env: str, keys: Sequence[PromptKey], before: ByPrompt, after: ByPrompt) -> Comparison:
    deltas = [_mean(after[key], _reward) - _mean(before[key], _reward) for key in keys]
    return Comparison(
        env=env,
        prompts=len(keys),
        samples=len(before[keys[0]]),
        before=statistics.fmean(_mean(before[key], _reward) for key in keys),
        after=statistics.fmean(_mean(after[key], _reward) for key in keys),
        before_pass=statistics.fmean(_mean(before[key], _passed) for key in keys),
        after_pass=statistics.fmean(_mean(after[key], _passed) for key in keys),
        stderr=statistics.stdev(deltas) / math.sqrt(len(deltas)),
    )


def compare(before: Sequence[Rollout], after: Sequence[Rollout]) -> list[Comparison]:
    """One row per domain (first-seen order), then `all`; both runs must cover the same prompts."""
    first, second = _by_prompt(before), _by_prompt(after)
    if first.keys() != second.keys():
        raise ValueError("before and after must evaluate the same (environment, seed) prompts")
    sizes = {len(group) for group in (*first.values(), *second.values())}
    if len(sizes) != 1:
        raise ValueError(f"every prompt needs the same number of samples, found {sorted(sizes)}")
    domains = list(dict.fromkeys(env for env, _ in first))
    rows = []
    for domain in domains:
        keys = [key for key in first if key[0] == domain]
        if len(keys) < 2:
            raise ValueError(f"domain {domain!r} has {len(keys)} held-out prompt; a standard error needs 2")
        rows.append(_compare(domain, keys, first, second))
    rows.append(_compare(ALL, list(first), first, second))
    return rows


def policy_versions(rollouts: Sequence[Rollout]) -> list[int]:
    return sorted({version for rollout in rollouts for version in rollout.generated_versions})


# --- the job --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DemoResult:
    run_dir: Path
    comparisons: list[Comparison]  # per domain, then `all`
    history: list[Metrics]  # the trainer's metrics of every step
    held_out_seeds: dict[str, list[int]]
    versions_before: list[int]  # policy versions that generated the evaluations
    versions_after: list[int]
    timings_s: dict[str, float]

    @property
    def overall(self) -> Comparison:
        return self.comparisons[-1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "steps": len(self.history),
            "held_out": [row.to_dict() for row in self.comparisons],
            "clear_improvement": self.overall.clear,
            "held_out_seeds": self.held_out_seeds,
            "policy_versions": {"before": self.versions_before, "after": self.versions_after},
            "train_reward": [round(metrics["reward"], 4) for metrics in self.history],
            "timings_s": self.timings_s,
        }


def run_demo(
    config: DemoConfig,
    sandbox: SandboxProvider | None = None,
    registry: EnvRegistry | None = None,
    on_step: Callable[[Metrics], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> DemoResult:
    """Load the policy, evaluate it on held-out seeds, train, evaluate again with the trained weights."""
    phase = on_phase or (lambda _: None)
    timings: dict[str, float] = {}
    start = clock()
    trainer = build_trainer(config.train, registry=registry, sandbox=sandbox)
    try:
        source = trainer.rollouts
        assert isinstance(source, EngineRollouts), "the local backend rolls out with an in-process engine"
        timings["load_s"] = clock() - start
        plans = eval_plans(trainer.mixture.names, config.demo)
        params = SamplingParams(
            max_tokens=config.eval_max_new_tokens,
            temperature=config.eval_temperature,
            n=config.demo.samples_per_prompt,
        )
        phase(f"held-out evaluation before training: {len(plans)} prompts")
        mark = clock()
        before = evaluate(source, plans, params)
        timings["eval_before_s"] = clock() - mark
        phase(f"training: {config.train.run.steps} steps")
        mark = clock()
        history = trainer.run(on_step, final_checkpoint=False)
        timings["train_s"] = clock() - mark
        phase("held-out evaluation after training")
        mark = clock()
        after = evaluate(source, plans, params)
        timings["eval_after_s"] = clock() - mark
    finally:
        trainer.close()
    comparisons = compare(before, after)
    write_report(trainer.run_dir, [row.to_dict() for row in comparisons])
    seeds: dict[str, list[int]] = {}
    for plan in plans:
        seeds.setdefault(plan.env, []).append(plan.seed)
    timings["total_s"] = clock() - start
    return DemoResult(
        run_dir=trainer.run_dir,
        comparisons=comparisons,
        history=history,
        held_out_seeds=seeds,
        versions_before=policy_versions(before),
        versions_after=policy_versions(after),
        timings_s=timings,
    )


def comparison_table(result: DemoResult) -> Table:
    """The before/after table: held-out reward and pass rate per domain, the gain and its noise."""
    table = Table(title=f"held-out evaluation before and after {len(result.history)} RL steps")
    table.add_column("domain", no_wrap=True)
    for column in ("prompts x n", "before", "after", "gain", "2 se", "pass before -> after", "verdict"):
        table.add_column(column, justify="right", no_wrap=True)
    for row in result.comparisons:
        table.add_row(
            row.env,
            f"{row.prompts} x {row.samples}",
            f"{row.before:.3f}",
            f"{row.after:.3f}",
            f"{row.delta:+.3f}",
            f"{Z_CLEAR * row.stderr:.3f}",
            f"{row.before_pass:.0%} -> {row.after_pass:.0%}",
            "clear gain" if row.clear else "within noise",
            style="bold" if row.env == ALL else None,
        )
    return table
