"""The RL loop: plan prompts -> generate and score rollouts -> learn -> push weights -> record.

`Trainer` wires a `RolloutSource` (`sources.py`: an engine in this process, servers or Ray workers), a
`Learner` (updates), environments (scoring) and a run directory (`config.toml`, `metrics.jsonl`,
`transcripts.jsonl`, `warnings.jsonl` of the reward-hacking monitors, `cost.json`, `checkpoints/`). A
policy version is the number of completed steps. Sync mode generates each batch with the current weights
(staleness 0); async mode (`pipeline.py`) generates ahead on a rollout thread within `max_staleness`
versions. Everything random is derived from (seed, step), and checkpoints hold the rest, so a resumed run
repeats an uninterrupted one.
The trainer does no printing: callers watch it through the `on_step` callback.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from tether.engine.sampling import SamplingParams
from tether.envs.context import ScoringContext
from tether.envs.registry import EnvRegistry, Mixture, mixture_from_weights
from tether.envs.tasks import Task
from tether.errors import ConfigError
from tether.rl.advantages import group_advantages, overlong_penalty
from tether.rl.checkpoint import (
    PendingCheckpoint,
    has_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_extra,
    start_checkpoint,
    truncate_metrics,
)
from tether.rl.config import TrainConfig, dump_config
from tether.rl.cores import ThreadRole, TrainingThreads
from tether.rl.cost import COST_FILE, cost_metrics, summarize
from tether.rl.learner import Learner
from tether.rl.metrics import add_counters, domain_metrics, staleness
from tether.rl.monitors import WARNINGS, WARNINGS_FILE, monitor_metrics, over_thresholds
from tether.rl.pipeline import WeightStore, run_async
from tether.rl.report import read_metrics, write_report
from tether.rl.retries import RetryPolicy, check_failure_rate
from tether.rl.rollout import Rollout, plan_prompts
from tether.rl.samples import Sample
from tether.rl.sections import AlgorithmSection, Mode, RolloutSection
from tether.rl.sources import EngineRollouts, RolloutSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tether.engine.llm_engine import LLMEngine

Metrics = dict[str, float]


@dataclass(frozen=True, slots=True)
class Produced:
    """What rollout generation hands the learner for one step."""

    step: int
    tasks: list[Task]
    rollouts: list[Rollout]
    cursors: dict[str, int]  # the per-domain cursors after this step's prompts
    generate_s: float
    score_s: float
    counters: dict[str, float] = field(default_factory=dict)  # the source's events (`Generated.counters`)
    threads: int = 1  # torch threads of the thread that generated (at the start of generation)


@dataclass(frozen=True, slots=True)
class Batch:
    samples: list[Sample]
    dropped_groups: int  # DAPO dynamic sampling: groups whose scored rewards were all equal
    short_groups: int  # groups left with fewer scored samples than `[algorithm] min_group_samples`
    rewards_shaped_mean: float  # over scored rollouts


def to_samples(
    rollouts: Sequence[Rollout],
    algorithm: AlgorithmSection,
    group_size: int,
    max_new_tokens: int,
    policy_version: int | None = None,
) -> Batch:
    """Group rollouts by prompt, shape rewards, compute advantages, drop uninformative groups if asked.

    `rollouts` come `group_size` per prompt, prompts in order (as `generate_groups` returns them). An
    infra-failed rollout is no member of its group: the advantages, DAPO's filter and the overlong
    penalty see only the scored ones, and it never becomes a sample. A rollout with tokens older than
    `policy_version` (the learner's) is marked stale."""
    assert len(rollouts) % group_size == 0, "rollouts must come in whole groups"
    groups = len(rollouts) // group_size
    scored = [r.infra_failure is None for r in rollouts]
    assert all(math.isfinite(r.reward) for r, ok in zip(rollouts, scored, strict=True) if ok), (
        "a scored rollout has a finite reward (scoring marks any other invalid_reward)"
    )
    valid = torch.tensor(scored, dtype=torch.bool).view(groups, group_size)
    rewards = torch.tensor(
        [r.reward if ok else 0.0 for r, ok in zip(rollouts, scored, strict=True)], dtype=torch.float32
    ).view(groups, group_size)
    if algorithm.overlong_buffer_tokens > 0:
        lengths = torch.tensor([r.generated_tokens for r in rollouts]).view(groups, group_size)
        rewards = rewards + overlong_penalty(lengths, max_new_tokens, algorithm.overlong_buffer_tokens)
    grouped = group_advantages(
        algorithm.advantage,
        rewards,
        valid,
        min_samples=min(algorithm.min_group_samples, group_size),
        drop_equal=algorithm.drop_equal_groups,
    )
    samples = []
    for index, rollout in enumerate(rollouts):
        group, member = divmod(index, group_size)
        if grouped.kept[group] and valid[group, member]:
            samples.append(
                Sample(
                    token_ids=rollout.prompt_ids + rollout.completion_ids,
                    completion_start=len(rollout.prompt_ids),
                    behaviour_logprobs=list(rollout.logprobs),
                    advantage=float(grouped.advantages[group, member]),  # one per episode, on all its tokens
                    loss_mask=rollout.loss_mask,
                    stale=policy_version is not None
                    and any(v < policy_version for v in rollout.generated_versions),
                )
            )
    shaped = float(rewards[valid].mean()) if bool(valid.any()) else 0.0
    return Batch(samples, grouped.uninformative, grouped.too_few, shaped)


def sampling_params(rollout: RolloutSection) -> SamplingParams:
    return SamplingParams(
        max_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        n=rollout.samples_per_prompt,
    )


class Trainer:
    """The loop over a `RolloutSource` (default: `engine` in this process) and a `Learner`."""

    def __init__(
        self,
        config: TrainConfig,
        engine: LLMEngine | None,
        tokenizer: PreTrainedTokenizerBase | None,
        learner: Learner,
        registry: EnvRegistry,
        ctx: ScoringContext,
        clock: Callable[[], float] = time.monotonic,
        rollouts: RolloutSource | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.learner = learner
        self.registry = registry
        self.mixture: Mixture = mixture_from_weights(registry, config.envs.weights)
        self.ctx = ctx
        self.clock = clock
        self.run_dir = config.run_dir
        self.step = 0  # completed steps
        self.cursors: dict[str, int] = {}
        self.stop_requested = False
        self._pending: PendingCheckpoint | None = None  # a checkpoint still being written
        # Torch threads: sized by the caller (`configure_threads`), then following the free cores.
        split = config.run.mode is Mode.ASYNC
        self.threads = TrainingThreads.for_run(config.run.adapt_threads, split, config.run.threads_window_s)
        if engine is not None and not self.threads.split:  # the engine steps on this thread: it follows too
            engine.follow_cores(self.threads.governor)
        self.weight_store = WeightStore()  # async mode: the policy versions batches are generated with
        self.params = sampling_params(config.rollout)
        if rollouts is None:
            assert engine is not None and tokenizer is not None, "without a rollout source: an engine"
            retry = RetryPolicy.of(config.rollout)
            rollouts = EngineRollouts(engine, tokenizer, registry, ctx, self.params, clock, retry=retry)
        self.rollouts = rollouts

    # --- run directory -----------------------------------------------------------------------------

    def start_run_dir(self, resume: bool) -> None:
        """Create the run directory, or (resume) reload the latest checkpoint from it."""
        if resume:
            checkpoint = latest_checkpoint(self.run_dir)
            load_checkpoint(checkpoint, self.learner)
            self.step = checkpoint.step
            self.cursors = {k: int(v) for k, v in checkpoint.trainer["cursors"].items()}
            if self.config.run.mode is Mode.SYNC:  # async: the rollout thread loads what each batch needs
                self.push(self.learner.weights(), self.step)
            for version, weights in load_extra(checkpoint).get("snapshots", {}).items():
                self.weight_store.put(int(version), weights)
            for name in ("metrics.jsonl", "transcripts.jsonl", WARNINGS_FILE):
                truncate_metrics(self.run_dir / name, self.step)
            return
        if has_checkpoint(self.run_dir):
            raise ConfigError(
                f"run directory {str(self.run_dir)!r} already holds a run: resume it with --resume, "
                "or choose another run.name"
            )
        # A run killed before its first checkpoint committed left only steps it cannot resume from: it
        # starts over, and their lines go (the next save drops its partial checkpoint files).
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "transcripts.jsonl", WARNINGS_FILE):
            truncate_metrics(self.run_dir / name, 0)
        (self.run_dir / "config.toml").write_text(dump_config(self.config))

    def checkpoint(self) -> Path:
        """Save a checkpoint of the current step and redraw `report.html` up to it. With
        `learner.async_checkpoint` its files are written in the background while training goes on, and
        it becomes the latest when they are done (`finish_checkpoint`: at the next checkpoint, at the
        end of the run, or on close); a run killed before then resumes from the previous one."""
        self.finish_checkpoint()
        self._pending = start_checkpoint(
            self.run_dir,
            self.step,
            self.learner,  # LoRA: the adapters only
            {"cursors": self.cursors},
            keep=self.config.run.keep_checkpoints,
            # async: weights of older versions that batches still to be generated need
            extra={"snapshots": self.weight_store.versions(below=self.step)},
        )
        path = self._pending.final
        if not self.config.learner.async_checkpoint:
            self.finish_checkpoint()
        return path

    def finish_checkpoint(self) -> None:
        """Make the checkpoint being written the latest, once its files are all written."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()
            self.write_cost()
            write_report(self.run_dir)

    def write_cost(self) -> Path:
        """(Re)write `cost.json`: the run's token counts and their exact cost per tier at `[cost]`'s
        prices, summed from `metrics.jsonl` (so a resumed run's total counts each step once)."""
        summary = summarize(read_metrics(self.run_dir / "metrics.jsonl"), self.config.cost.prices)
        path = self.run_dir / COST_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
        tmp.replace(path)
        return path

    def maybe_checkpoint(self) -> None:
        if self.step % self.config.run.checkpoint_every == 0:
            self.checkpoint()

    def record(self, metrics: Metrics) -> None:
        self._append("metrics.jsonl", [metrics])

    def _append(self, name: str, rows: Sequence[dict[str, Any]]) -> None:
        with open(self.run_dir / name, "a") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")

    # --- one step: produce (plan, generate, score) then learn (update, push, record) -----------------

    def produce(self, step: int, cursors: dict[str, int]) -> Produced:
        """The scored rollouts of `step`, generated with whatever weights the engine holds now."""
        config = self.config
        plans, advanced = plan_prompts(
            self.mixture,
            cursors,
            config.rollout.prompts_per_step,
            config.run.seed,
            step,
            config.envs.seed_offset,
        )
        threads = self.threads.take(ThreadRole.ROLLOUT)  # async: this runs on the rollout thread
        out = self.rollouts.generate(plans)
        return Produced(
            step, out.tasks, out.rollouts, advanced, out.generate_s, out.score_s, out.counters, threads
        )

    def learn(self, produced: Produced) -> tuple[Metrics, bool]:
        """One update from a produced batch; returns its metrics and whether the weights changed."""
        config = self.config
        assert produced.step == self.step, f"batch of step {produced.step} given at step {self.step}"
        start = self.clock()
        learner_threads = self.threads.take(ThreadRole.LEARNER)
        rollouts = produced.rollouts
        # Before anything of the step is learned or recorded: a resumed run meets the same batch again.
        check_failure_rate(rollouts, config.rollout.max_infra_failure_rate)
        batch = to_samples(
            rollouts,
            config.algorithm,
            config.rollout.samples_per_prompt,
            config.rollout.max_new_tokens,
            policy_version=self.step,
        )
        metrics: Metrics = {"step": float(self.step + 1)}
        metrics.update(staleness(rollouts, self.step))
        if batch.samples:
            metrics.update(self.learner.step(batch.samples).to_dict())
        # else every group was uninformative or too short: nothing to learn from, the policy stays
        self.cursors = produced.cursors
        self.step += 1
        completion_tokens = sum(r.generated_tokens for r in rollouts)
        metrics.update(domain_metrics(rollouts))
        metrics.update(self.observe(produced))
        add_counters(metrics, produced.counters)
        metrics.update(self.threads.metrics(produced.threads, learner_threads))
        metrics.update(
            {
                "policy_version": float(self.step),
                "dropped_groups": float(batch.dropped_groups),
                "rollout/groups_dropped": float(batch.short_groups),
                "trained_sequences": float(len(batch.samples)),
                "reward_shaped": batch.rewards_shaped_mean,
                "time/generate_s": produced.generate_s,
                "time/score_s": produced.score_s,
                "time/learn_s": self.clock() - start,
                "generated_tokens": float(completion_tokens),
                "tokens_per_s": completion_tokens / max(produced.generate_s, 1e-9),
            }
        )
        keep = rollouts[:: config.rollout.samples_per_prompt][: config.run.transcripts_per_step]
        self._append(
            "transcripts.jsonl",
            [{"step": self.step, "prompt": produced.tasks[r.group].messages, **r.to_dict()} for r in keep],
        )
        return metrics, bool(batch.samples)

    def observe(self, produced: Produced) -> Metrics:
        """The step's tokens, cost and sandbox CPU, and its reward-hacking monitors; those over their
        threshold are appended to `warnings.jsonl` and counted as `monitor/warnings`."""
        config, tasks = self.config, produced.tasks
        metrics = cost_metrics(produced.rollouts, config.cost.prices)

        def exploits(rollout: Rollout) -> list[str]:
            return self.registry.get(rollout.env).exploits_in(tasks[rollout.group], rollout.text)

        metrics.update(monitor_metrics(produced.rollouts, exploits, config.monitors))
        warnings = over_thresholds(metrics, config.monitors)
        metrics[WARNINGS] = float(len(warnings))
        self._append(WARNINGS_FILE, [{"step": self.step, **warning.to_dict()} for warning in warnings])
        return metrics

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load `weights` into the rollout source; its tokens are then recorded as `version` (the step)."""
        self.rollouts.load(weights, version)

    def train_step(self) -> Metrics:
        """Sync mode: produce with the current weights, learn, push; returns (and appends) the metrics."""
        start = self.clock()
        metrics, _ = self.learn(self.produce(self.step, self.cursors))
        pushed = self.clock()
        self.push(self.learner.weights(), self.step)
        metrics["time/push_s"] = self.clock() - pushed
        metrics["time/step_s"] = self.clock() - start
        self.record(metrics)
        return metrics

    def close(self) -> None:
        """Stop the rollout source (its sandbox pool and event loop, or its workers), then the learner
        (a sharded one: its other ranks)."""
        try:
            self.finish_checkpoint()
        finally:
            try:
                self.rollouts.close()
            finally:
                self.learner.close()

    # --- the loop ----------------------------------------------------------------------------------

    def request_stop(self, signum: int = 0, frame: FrameType | None = None) -> None:
        """Finish the current step, checkpoint and return (what SIGTERM and Ctrl-C do during `run`)."""
        self.stop_requested = True

    def run(
        self, on_step: Callable[[Metrics], None] | None = None, final_checkpoint: bool = True
    ) -> list[Metrics]:
        """Train until `run.steps` (or a stop request); checkpoints every N steps and at the end
        (`final_checkpoint = False`: a throwaway run, e.g. the benchmark's, skips the last one)."""
        main = threading.current_thread() is threading.main_thread()
        stops = (signal.SIGTERM, signal.SIGINT)
        previous = {signum: signal.signal(signum, self.request_stop) for signum in stops} if main else {}
        try:
            if self.config.run.mode is Mode.ASYNC:
                history = run_async(self, on_step)
            else:
                history = self._run_sync(on_step)
            if final_checkpoint and self.step % self.config.run.checkpoint_every != 0:
                self.checkpoint()
            self.finish_checkpoint()
            self.write_cost()  # also when no checkpoint was written (a demo's throwaway run)
        finally:
            torch.set_num_threads(self.threads.total)  # async: this thread held the learner's share
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return history

    def _run_sync(self, on_step: Callable[[Metrics], None] | None) -> list[Metrics]:
        history = []
        while self.step < self.config.run.steps and not self.stop_requested:
            metrics = self.train_step()
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)
            self.maybe_checkpoint()
        return history
