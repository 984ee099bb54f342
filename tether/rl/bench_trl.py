"""The baseline of `tether rl bench`: the same steps with TRL's GRPOTrainer, imported when its run starts
(TRL is a benchmark-only dependency)."""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tether.envs.bench import BENCH_ENV, reward
from tether.envs.registry import default_registry
from tether.envs.tasks import Task
from tether.errors import ConfigError
from tether.rl.bench_config import TRL_HINT, BenchConfig, CpuClock, Progress, StepTimes


def run_trl(
    config: BenchConfig, out_dir: Path, progress: Progress, batch: Sequence[Task] | None = None
) -> StepTimes:
    """The same steps with TRL's GRPOTrainer (transformers model, its own generate and loss); with
    `batch`, every step on those prompts, in order (the informative batch)."""
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
    if batch is None:
        tasks: list[Task] = [env.task(seed) for seed in range(config.prompts * config.total_steps)]
    else:
        tasks = [task for _ in range(config.total_steps) for task in batch]
    dataset = datasets.Dataset.from_list([{"prompt": t.messages, "answer": t.reference} for t in tasks])
    times, clock = StepTimes(), CpuClock()
    phases: dict[str, float] = {}  # the current step's (`PHASES`), added up by the timed methods

    def correct(completions: Sequence[Any], answer: Sequence[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        return [reward(text, ref) for text, ref in zip(texts, answer, strict=True)]

    class Timer(TrainerCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            self.last = time.perf_counter()
            clock.lap()

        def on_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            # From the end of the backward (the last timed call): clipping and AdamW's step, as tether's.
            add("optimizer_s", last_end[0])

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            times.step_s.append(now - self.last)
            times.generate_s.append(phases.get("generate_s", 0.0))
            times.cpu_s.append(clock.lap())
            times.add_phases(now - self.last, phases)
            self.last = now
            phases.clear()

        def on_log(self, *args: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
            if logs and "reward" in logs:
                times.reward.append(float(logs["reward"]))
                zero = float(logs.get("frac_reward_zero_std", 0.0))
                times.zero_advantage.append(zero)
                times.informative_groups.append(round((1 - zero) * config.prompts))
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
        shuffle_dataset=batch is None,  # the informative batch: each step's prompts in order
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
    last_end = [0.0]  # when the last timed method returned

    def add(name: str, start: float) -> None:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start

    def timed(method: Any, name: str | None) -> Any:
        """`method`, its seconds added to phase `name` (None: a logprob forward, which is the learner's
        `forward_s` with gradients and a `recompute_s` of old or reference logprobs without)."""

        def wrapper(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*a, **kw)
            finally:
                add(name or ("forward_s" if torch.is_grad_enabled() else "recompute_s"), start)
                last_end[0] = time.perf_counter()

        return wrapper

    trainer._generate = timed(trainer._generate, "generate_s")
    trainer._calculate_rewards = timed(trainer._calculate_rewards, "score_s")
    trainer._get_per_token_logps_and_entropies = timed(trainer._get_per_token_logps_and_entropies, None)
    trainer.accelerator.backward = timed(trainer.accelerator.backward, "backward_s")
    trainer.train()
    return times
