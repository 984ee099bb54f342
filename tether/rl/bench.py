"""`tether rl bench`: seconds per GRPO training step, tether (sync and async) against TRL's GRPOTrainer.

All runs share one invocation, model (full fine-tuning), task, batch and machine: integer arithmetic
generated from seeds, reward 1 when the completion's last integer is the answer. Each figure is a median
over the measured steps that follow the warm-up steps; each step also records its generation seconds
and the process CPU seconds it used (the steadier figure on a shared machine). In async mode the step is
the learner's (generation of the next batch overlaps it), so its generation share is the time the learner
waited for a batch. TRL is a benchmark-only dependency, imported when its run starts. Nothing is printed.

Besides these steps (seeded prompts as a training run draws them, most groups all 0 early on, which
tether skips and TRL computes), the *informative step* is measured on its own (`informative.py`): a batch
whose every group was probed to score mixed rewards, tether's sync step 0 and async step 1 from the
initial weights (each batch generated with them, so the probe's completions are the step's) against TRL
on the same prompts, with how many groups of each timed step really were informative. The sync step is
a fresh run's first (after the regular runs warmed the process); AdamW's state is allocated and the
trained weights copied off the checkpoint's file mapping with the learner before it, as TRL's are in its
load and warm-up step, so neither timed step pays for that. Every run uses
the same fixed torch thread count (tether's adaptive threads off), recorded with the machine, and the
same allocator settings: freed heap memory kept (`models.host_heap`), as tether's learner sets it.

Every step is also broken into phases (`bench_config.PHASES`: generation, scoring, no-grad logprob
recomputes, the learner's forward, backward and optimizer step, the weight sync, and the rest), each
step's summing to its time, for tether from its metrics (`tether_phases`) and for TRL from its timed
methods: where a step's time goes, next to how long it took.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tether.envs.bench import BENCH_ENV
from tether.envs.registry import EnvRegistry, default_registry
from tether.machine import load_average
from tether.models.host_heap import keep_freed_memory
from tether.rl.bench_config import BenchConfig, CpuClock, Progress, StepTimes
from tether.rl.bench_trl import run_trl
from tether.rl.config import TrainConfig, parse_config
from tether.rl.informative import (
    INFORMATIVE_ENV,
    choose_informative,
    engine_probe,
    informative_groups,
    informative_registry,
    sample_seeds,
)
from tether.rl.sections import Mode
from tether.rl.sources import Generated, RolloutSource

# --- tether ------------------------------------------------------------------------------------------------


def train_config(
    config: BenchConfig, mode: Mode, out_dir: Path, env: str = BENCH_ENV, steps: int | None = None
) -> TrainConfig:
    """The `tether train` config of one benchmark run (throwaway: no checkpoint, no transcripts) on
    `env`, `steps` steps (default: the warm-up and measured ones), threads fixed."""
    steps = config.total_steps if steps is None else steps
    model: dict[str, Any] = {"name": config.model, "kv_cache_mib": config.kv_cache_mib}
    if config.cache_dir is not None:
        model["cache_dir"] = str(config.cache_dir)
    raw = {
        "model": model,
        "envs": {"weights": {env: 1.0}},
        "rollout": {
            "prompts_per_step": config.prompts,
            "samples_per_prompt": config.samples,
            "max_new_tokens": config.max_new_tokens,
            "temperature": 1.0,
        },
        # The whole batch in one forward and backward, as TRL's (per_device_train_batch_size = the batch,
        # no accumulation): the learner packs its weights once per step instead of once per micro-batch.
        "optim": {"lr": config.lr, "micro_batch": config.prompts * config.samples},
        "run": {
            "name": f"tether-{mode.value}-{env.replace('/', '-')}",
            "out_dir": str(out_dir),
            "steps": steps,
            "seed": config.seed,
            "mode": mode.value,
            "checkpoint_every": steps + 1,  # a throwaway run: no checkpoint
            "transcripts_per_step": 0,
            "adapt_threads": False,  # TRL's threads are fixed: so are these, for a like-for-like step
        },
    }
    return parse_config(raw, "bench")


class RecordedRewards:
    """A `RolloutSource` that keeps the rewards of every batch it generates, in order (batch i is step
    i's in either mode), so the bench can count a step's informative groups."""

    def __init__(self, inner: RolloutSource) -> None:
        self.inner = inner
        self.batches: list[list[float]] = []

    def generate(self, plans: Any) -> Generated:
        out = self.inner.generate(plans)
        self.batches.append([r.reward for r in out.rollouts])
        return out

    def load(self, weights: Any, version: int) -> None:
        self.inner.load(weights, version)

    def close(self) -> None:
        self.inner.close()


def tether_phases(metrics: dict[str, float], mode: Mode) -> dict[str, float]:
    """A tether step's phases (`PHASES`) from its metrics. In async mode generation and scoring run on
    the rollout thread, overlapping the learner: the step holds only the time it waited for a batch
    (`generate_s`), and publishing the weights for that thread is its weight sync."""
    phases = {
        "forward_s": metrics.get("time/forward_s", 0.0),  # absent: nothing to learn, no forward
        "backward_s": metrics.get("time/backward_s", 0.0),
        "optimizer_s": metrics.get("time/optimizer_s", 0.0),
        "weight_sync_s": metrics["time/push_s"],
    }
    if mode is Mode.ASYNC:
        return {**phases, "generate_s": metrics["time/wait_s"]}
    return {**phases, "generate_s": metrics["time/generate_s"], "score_s": metrics["time/score_s"]}


def run_tether(
    config: BenchConfig,
    mode: Mode,
    out_dir: Path,
    progress: Progress,
    env: str = BENCH_ENV,
    registry: EnvRegistry | None = None,
    steps: int | None = None,
) -> StepTimes:
    from tether.rl.builders import build_trainer

    train = train_config(config, mode, out_dir, env, steps)
    trainer = build_trainer(train, registry)
    recorded = RecordedRewards(trainer.rollouts)
    trainer.rollouts = recorded
    times, clock = StepTimes(), CpuClock()

    def on_step(metrics: dict[str, float]) -> None:
        waited = metrics["time/wait_s"] if mode is Mode.ASYNC else metrics["time/generate_s"]
        times.step_s.append(metrics["time/step_s"])
        times.generate_s.append(waited)
        times.cpu_s.append(clock.lap())
        times.reward.append(metrics["reward"])
        skipped = metrics["learner/skipped_sequences"]  # the bench drops no group: the learner ran
        times.zero_advantage.append(skipped / metrics["rollouts"])
        rewards = recorded.batches[len(times.step_s) - 1]
        times.informative_groups.append(informative_groups(rewards, config.samples))
        times.add_phases(metrics["time/step_s"], tether_phases(metrics, mode))
        progress(
            f"tether {mode.value}: step {len(times.step_s)}/{train.run.steps} "
            f"{metrics['time/step_s']:.1f} s, reward {metrics['reward']:.2f}"
        )

    try:
        trainer.run(on_step, final_checkpoint=False)
    finally:
        trainer.close()
    return times


# --- the benchmark -----------------------------------------------------------------------------------------


def choose_batch(config: BenchConfig, out_dir: Path, progress: Progress) -> tuple[list[int], int]:
    """The informative batch's task seeds, step 0's groups then step 1's (the async step timed is step
    1, also generated with the initial weights), probed with the run's engine settings; and how many
    prompts the search sampled."""
    from tether.rl.builders import make_engine
    from tether.rl.trainer import sampling_params

    train = train_config(config, Mode.SYNC, out_dir)
    engine, tokenizer = make_engine(train, train.model.device)
    probe = engine_probe(engine, tokenizer, sampling_params(train.rollout))
    probed = [0]

    def counted(groups: Sequence[tuple[int, int]]) -> list[list[float]]:
        progress(f"informative step: probing {len(groups)} prompts ({probed[0]} probed so far)")
        probed[0] += len(groups)
        return probe(groups)

    slots = sample_seeds(config.seed, 2, config.prompts)
    return choose_informative(slots, counted, itertools.count(), config.probe_budget), probed[0]


def run_informative(config: BenchConfig, work: Path, threads: int, progress: Progress) -> dict[str, Any]:
    """The informative step: tether sync (step 0) and async (step 1) of `informative_repeats` fresh runs
    on the probed batch, and TRL's steps on its step-0 prompts; the JSON-ready result."""
    import torch

    seeds, probed = choose_batch(config, work, progress)
    sync, asynchronous = StepTimes(), StepTimes()
    for repeat in range(config.informative_repeats):
        for mode, steps, times in ((Mode.SYNC, 1, sync), (Mode.ASYNC, 2, asynchronous)):
            torch.set_num_threads(threads)
            torch.manual_seed(config.seed)
            out_dir = work / f"informative-{repeat}"
            registry = informative_registry(seeds)  # a fresh one per run: the trainer adds to it
            run = run_tether(config, mode, out_dir, progress, INFORMATIVE_ENV, registry, steps)
            times.add(run, steps - 1)
    result: dict[str, Any] = {
        "task_seeds": seeds,
        "probed_prompts": probed,
        "groups": config.prompts,
        "tether_sync": sync.summary(0),
        "tether_async": asynchronous.summary(0),
    }
    if config.trl:
        torch.set_num_threads(threads)
        torch.manual_seed(config.seed)
        env = default_registry().get(BENCH_ENV)
        batch = [env.task(seed) for seed in seeds[: config.prompts]]
        result["trl"] = run_trl(config, work / "informative-trl", progress, batch).summary(
            config.warmup_steps
        )
    return result


# The regular steps' figures keep the names earlier results used; the informative step's are
# `informative_{figure}_speedup_vs_trl`.
REGULAR_KEYS = {
    "step": "step_speedup_vs_trl",
    "step_async": "async_step_speedup_vs_trl",
    "cpu": "cpu_speedup_vs_trl",
    "cpu_async": "async_cpu_speedup_vs_trl",
}


def speedups(runs: dict[str, Any]) -> dict[str, float]:
    """TRL's median seconds over tether's per step of `runs`, wall (`step`) and process CPU (`cpu`),
    against sync and async (`_async`); empty without a TRL run."""
    if "trl" not in runs:
        return {}
    trl, sync, asynchronous = runs["trl"], runs["tether_sync"], runs["tether_async"]
    return {
        "step": trl["step_s"] / sync["step_s"],
        "step_async": trl["step_s"] / asynchronous["step_s"],
        "cpu": trl["cpu_s"] / sync["cpu_s"],
        "cpu_async": trl["cpu_s"] / asynchronous["cpu_s"],
    }


def all_informative(informative: dict[str, Any]) -> bool:
    """Whether every timed tether step of the informative result had all its groups mixed (the figure
    is only valid then; TRL samples its own completions, so its count is recorded, not required)."""
    groups = informative["groups"]
    return all(
        count == groups
        for run in ("tether_sync", "tether_async")
        for count in informative[run]["informative_groups"]
    )


def run_bench(config: BenchConfig, progress: Progress = lambda _: None) -> dict[str, Any]:
    """Run tether sync, tether async and (if asked) TRL on the same steps, then (if asked) the
    informative step; the JSON-ready result."""
    import torch

    from tether.engine.bench_machine import machine_info
    from tether.models.threads import configure_threads

    load_start = load_average()
    if config.threads is None:
        threads = configure_threads()
    else:
        threads = config.threads
        torch.set_num_threads(threads)
    # tether's learner keeps freed heap memory (`host_heap`), for the whole process: set before any run,
    # so that TRL's runs here have the same allocator settings as tether's, whichever runs first.
    freed_memory_kept = keep_freed_memory()
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="tether-rl-bench-"))
    runs: dict[str, dict[str, Any]] = {}
    load: dict[str, list[float]] = {}
    informative: dict[str, Any] | None = None
    try:
        plan: list[tuple[str, Callable[[], StepTimes]]] = [
            ("tether_sync", lambda: run_tether(config, Mode.SYNC, work, progress)),
            ("tether_async", lambda: run_tether(config, Mode.ASYNC, work, progress)),
        ]
        if config.trl:
            plan.append(("trl", lambda: run_trl(config, work, progress)))
        for name, run in plan:
            progress(f"{name}: loading")
            torch.set_num_threads(threads)
            torch.manual_seed(config.seed)
            before = os.getloadavg()[0]
            runs[name] = run().summary(config.warmup_steps)
            load[name] = [round(before, 2), round(os.getloadavg()[0], 2)]
        if config.informative:
            before = os.getloadavg()[0]
            informative = run_informative(config, work, threads, progress)
            load["informative"] = [round(before, 2), round(os.getloadavg()[0], 2)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {
        "model": config.model,
        "task": BENCH_ENV,
        "batch": {
            "prompts": config.prompts,
            "samples": config.samples,
            "max_new_tokens": config.max_new_tokens,
        },
        "steps": {"warmup": config.warmup_steps, "measured": config.steps},
        "lr": config.lr,
        "torch_threads": threads,
        "adapt_threads": False,
        "cores": os.cpu_count(),
        "load_average_1m": load,  # before and after each run: the machine may be shared
        "freed_memory_kept": freed_memory_kept,  # the allocator setting every run had (`host_heap`)
        "bench_s": round(time.perf_counter() - started, 1),
        **runs,
        "machine": machine_info(
            threads, load_start, {f"after {name}": after for name, (_before, after) in load.items()}
        ),
    }
    result.update({REGULAR_KEYS[name]: ratio for name, ratio in speedups(runs).items()})
    if informative is not None:
        informative["all_groups_informative"] = all_informative(informative)
        result["informative"] = informative
        ratios = speedups(informative)
        result.update({f"informative_{name}_speedup_vs_trl": ratio for name, ratio in ratios.items()})
    return result
