"""`tether rl bench`: seconds per GRPO training step, tether (sync and async) against TRL's GRPOTrainer.

All runs share one invocation, model (full fine-tuning), task, batch and machine: integer arithmetic
generated from seeds, reward 1 when the completion's last integer is the answer. Each figure is a median
over the measured steps that follow the warm-up steps; each step also records its generation seconds
and the process CPU seconds it used (the steadier figure on a shared machine). In async mode the step is
the learner's (generation of the next batch overlaps it), so its generation share is the time the learner
waited for a batch. TRL is a benchmark-only dependency, imported when its run starts. Nothing is printed.
"""

from __future__ import annotations

import importlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.envs.bench import BENCH_ENV, reward
from tether.envs.registry import default_registry
from tether.envs.tasks import Task
from tether.errors import ConfigError
from tether.machine import load_average
from tether.rl.config import TrainConfig, parse_config
from tether.rl.sections import Mode

Progress = Callable[[str], None]

TRL_HINT = "pip install 'trl>=1.0,<2' (a benchmark-only dependency), or leave TRL out with --no-trl"


# --- configuration and results ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BenchConfig:
    model: str = "smollm2-135m-instruct"  # registered name or HF folder (TRL needs the folder's HF files)
    cache_dir: Path | None = None  # model cache (None: the tether settings' default)
    prompts: int = 8  # prompts per step
    samples: int = 4  # completions per prompt
    max_new_tokens: int = 64
    steps: int = 3  # measured steps, after the warm-up steps
    warmup_steps: int = 1
    lr: float = 3e-5
    seed: int = 0
    kv_cache_mib: int = 256  # tether engine KV cache, MiB
    trl: bool = True  # also run TRL's GRPOTrainer (needs `trl`)

    def __post_init__(self) -> None:
        counts = {
            "prompts": self.prompts,
            "samples": self.samples,
            "max_new_tokens": self.max_new_tokens,
            "steps": self.steps,
            "kv_cache_mib": self.kv_cache_mib,
        }
        for name, value in counts.items():
            if value < 1:
                raise ConfigError(f"bench {name} = {value}: expected an integer >= 1")
        if self.samples < 2:
            raise ConfigError(f"bench samples = {self.samples}: GRPO needs >= 2 completions per prompt")
        if self.warmup_steps < 0:
            raise ConfigError(f"bench warmup_steps = {self.warmup_steps}: expected an integer >= 0")
        if not 0 < self.lr <= 1:
            raise ConfigError(f"bench lr = {self.lr}: expected a learning rate in (0, 1]")

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps


@dataclass(slots=True)
class StepTimes:
    """Per-step figures of one run, warm-up steps included."""

    step_s: list[float] = field(default_factory=list)
    generate_s: list[float] = field(default_factory=list)  # async: seconds the learner waited for a batch
    cpu_s: list[float] = field(default_factory=list)  # process CPU seconds (every thread)
    reward: list[float] = field(default_factory=list)
    # Share of sequences in all-equal-reward groups (advantage 0): tether skips their forward, TRL not.
    zero_advantage: list[float] = field(default_factory=list)

    def summary(self, warmup: int) -> dict[str, Any]:
        step, generate = self.step_s[warmup:], self.generate_s[warmup:]
        return {
            "step_s": statistics.median(step),
            "generate_s": statistics.median(generate),
            "generate_fraction": statistics.median(
                g / max(s, 1e-9) for g, s in zip(generate, step, strict=True)
            ),
            "cpu_s": statistics.median(self.cpu_s[warmup:]),
            "steps_s": [round(s, 3) for s in self.step_s],
            "reward": [round(r, 4) for r in self.reward],
            "zero_advantage_fraction": [round(z, 4) for z in self.zero_advantage],
        }


class _Clock:
    """CPU seconds since the last call."""

    def __init__(self) -> None:
        self.last = time.process_time()

    def lap(self) -> float:
        now = time.process_time()
        spent, self.last = now - self.last, now
        return spent


# --- tether ------------------------------------------------------------------------------------------------


def train_config(config: BenchConfig, mode: Mode, out_dir: Path) -> TrainConfig:
    """The `tether train` config of one benchmark run (throwaway: no checkpoint, no transcripts)."""
    model: dict[str, Any] = {"name": config.model, "kv_cache_mib": config.kv_cache_mib}
    if config.cache_dir is not None:
        model["cache_dir"] = str(config.cache_dir)
    raw = {
        "model": model,
        "envs": {"weights": {BENCH_ENV: 1.0}},
        "rollout": {
            "prompts_per_step": config.prompts,
            "samples_per_prompt": config.samples,
            "max_new_tokens": config.max_new_tokens,
            "temperature": 1.0,
        },
        "optim": {"lr": config.lr},
        "run": {
            "name": f"tether-{mode.value}",
            "out_dir": str(out_dir),
            "steps": config.total_steps,
            "seed": config.seed,
            "mode": mode.value,
            "checkpoint_every": config.total_steps + 1,  # a throwaway run: no checkpoint
            "transcripts_per_step": 0,
        },
    }
    return parse_config(raw, "bench")


def run_tether(config: BenchConfig, mode: Mode, out_dir: Path, progress: Progress) -> StepTimes:
    from tether.rl.builders import build_trainer

    trainer = build_trainer(train_config(config, mode, out_dir))
    times, clock = StepTimes(), _Clock()

    def on_step(metrics: dict[str, float]) -> None:
        waited = metrics["time/wait_s"] if mode is Mode.ASYNC else metrics["time/generate_s"]
        times.step_s.append(metrics["time/step_s"])
        times.generate_s.append(waited)
        times.cpu_s.append(clock.lap())
        times.reward.append(metrics["reward"])
        skipped = metrics["learner/skipped_sequences"]  # the bench drops no group: the learner ran
        times.zero_advantage.append(skipped / metrics["rollouts"])
        progress(
            f"tether {mode.value}: step {len(times.step_s)}/{config.total_steps} "
            f"{metrics['time/step_s']:.1f} s, reward {metrics['reward']:.2f}"
        )

    try:
        trainer.run(on_step, final_checkpoint=False)
    finally:
        trainer.close()
    return times


# --- TRL ---------------------------------------------------------------------------------------------------


def run_trl(config: BenchConfig, out_dir: Path, progress: Progress) -> StepTimes:
    """The same steps with TRL's GRPOTrainer (transformers model, its own generate and loss)."""
    try:  # untyped, optional: used as Any
        datasets: Any = importlib.import_module("datasets")
        trl: Any = importlib.import_module("trl")
    except ImportError as error:
        raise ConfigError(f"TRL is not installed ({error}): {TRL_HINT}") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from tether.models.loader import resolve

    folder = resolve(config.model, config.cache_dir)
    env = default_registry().get(BENCH_ENV)
    tasks: list[Task] = [env.task(seed) for seed in range(config.prompts * config.total_steps)]
    dataset = datasets.Dataset.from_list([{"prompt": t.messages, "answer": t.reference} for t in tasks])
    times, clock = StepTimes(), _Clock()
    generating = [0.0]

    def correct(completions: Sequence[Any], answer: Sequence[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        return [reward(text, ref) for text, ref in zip(texts, answer, strict=True)]

    class Timer(TrainerCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            self.last = time.perf_counter()
            clock.lap()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            times.step_s.append(now - self.last)
            times.generate_s.append(generating[0])
            times.cpu_s.append(clock.lap())
            self.last, generating[0] = now, 0.0

        def on_log(self, *args: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
            if logs and "reward" in logs:
                times.reward.append(float(logs["reward"]))
                times.zero_advantage.append(float(logs.get("frac_reward_zero_std", 0.0)))
                progress(
                    f"TRL: step {len(times.step_s)}/{config.total_steps} {times.step_s[-1]:.1f} s, "
                    f"reward {logs['reward']:.2f}"
                )

    args = trl.GRPOConfig(
        output_dir=str(out_dir / "trl"),
        per_device_train_batch_size=config.prompts * config.samples,
        gradient_accumulation_steps=1,
        num_generations=config.samples,
        max_completion_length=config.max_new_tokens,
        temperature=1.0,
        learning_rate=config.lr,
        max_steps=config.total_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,  # this CPU has no bfloat16 arithmetic; tether trains in float32 as well
        gradient_checkpointing=False,  # TRL's default recomputes activations; tether recomputes nothing
        seed=config.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=correct,
        args=args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(folder),
        callbacks=[Timer()],
    )
    generate = trainer._generate

    def timed_generate(*a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            generating[0] += time.perf_counter() - start

    trainer._generate = timed_generate
    trainer.train()
    return times


# --- the benchmark -----------------------------------------------------------------------------------------


def run_bench(config: BenchConfig, progress: Progress = lambda _: None) -> dict[str, Any]:
    """Run tether sync, tether async and (if asked) TRL on the same steps; the JSON-ready result."""
    import torch

    from tether.engine.bench_machine import machine_info
    from tether.models.threads import configure_threads

    load_start = load_average()
    threads = configure_threads()
    work = Path(tempfile.mkdtemp(prefix="tether-rl-bench-"))
    runs: dict[str, dict[str, Any]] = {}
    load: dict[str, list[float]] = {}
    try:
        plan: list[tuple[str, Callable[[], StepTimes]]] = [
            ("tether_sync", lambda: run_tether(config, Mode.SYNC, work, progress)),
            ("tether_async", lambda: run_tether(config, Mode.ASYNC, work, progress)),
        ]
        if config.trl:
            plan.append(("trl", lambda: run_trl(config, work, progress)))
        for name, run in plan:
            progress(f"{name}: loading")
            torch.manual_seed(config.seed)
            before = os.getloadavg()[0]
            runs[name] = run().summary(config.warmup_steps)
            load[name] = [round(before, 2), round(os.getloadavg()[0], 2)]
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
        "cores": os.cpu_count(),
        "load_average_1m": load,  # before and after each run: the machine may be shared
        **runs,
        "machine": machine_info(
            threads, load_start, {f"after {name}": after for name, (_before, after) in load.items()}
        ),
    }
    if "trl" in runs:
        sync = runs["tether_sync"]
        result["step_speedup_vs_trl"] = runs["trl"]["step_s"] / sync["step_s"]
        result["async_step_speedup_vs_trl"] = runs["trl"]["step_s"] / runs["tether_async"]["step_s"]
        result["cpu_speedup_vs_trl"] = runs["trl"]["cpu_s"] / sync["cpu_s"]
    return result
