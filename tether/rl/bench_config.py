"""`tether rl bench`'s settings and per-run figures (`BenchConfig`, `StepTimes`), shared by its tether
runs (`bench.py`) and its TRL baseline (`bench_trl.py`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.errors import ConfigError

Progress = Callable[[str], None]

# Where a step's wall time goes, for tether and TRL alike: generation, scoring (rewards), no-grad logprob
# forwards (old-policy or reference logprobs: tether's on-policy step has none, it reuses the engine's),
# the learner's forwards with the loss, backwards, clipping and optimizer step, the weights' push to the
# rollout engine (TRL generates with the model it trains: none), and `other_s`, the rest of the step.
PHASES = (
    "generate_s",
    "score_s",
    "recompute_s",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "weight_sync_s",
)

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
    threads: int | None = None  # torch threads of every run (None: the free cores at the start)
    informative: bool = True  # also time the informative step (every group mixed; `informative.py`)
    informative_repeats: int = 2  # fresh runs whose informative step is timed (the figure: their median)
    max_probes: int | None = None
    """Prompts the informative batch's search may sample before giving up (None: 64 per group)."""

    def __post_init__(self) -> None:
        counts = {
            "prompts": self.prompts,
            "samples": self.samples,
            "max_new_tokens": self.max_new_tokens,
            "steps": self.steps,
            "kv_cache_mib": self.kv_cache_mib,
            "informative_repeats": self.informative_repeats,
        }
        for name, value in counts.items():
            if value < 1:
                raise ConfigError(f"bench {name} = {value}: expected an integer >= 1")
        for name, optional in (("threads", self.threads), ("max_probes", self.max_probes)):
            if optional is not None and optional < 1:
                raise ConfigError(f"bench {name} = {optional}: expected an integer >= 1")
        if self.samples < 2:
            raise ConfigError(f"bench samples = {self.samples}: GRPO needs >= 2 completions per prompt")
        if self.warmup_steps < 0:
            raise ConfigError(f"bench warmup_steps = {self.warmup_steps}: expected an integer >= 0")
        if not 0 < self.lr <= 1:
            raise ConfigError(f"bench lr = {self.lr}: expected a learning rate in (0, 1]")

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    @property
    def probe_budget(self) -> int:
        """`max_probes`, or 64 per group of the two steps the informative batch fills: at the default
        sizes (8 prompts x 4 samples, 64 tokens) 256 probes in all left 4 of 16 groups unmixed."""
        return self.max_probes if self.max_probes is not None else 64 * 2 * self.prompts


@dataclass(slots=True)
class StepTimes:
    """Per-step figures of one run, warm-up steps included."""

    step_s: list[float] = field(default_factory=list)
    generate_s: list[float] = field(default_factory=list)  # async: seconds the learner waited for a batch
    cpu_s: list[float] = field(default_factory=list)  # process CPU seconds (every thread)
    reward: list[float] = field(default_factory=list)
    # Share of sequences in all-equal-reward groups (advantage 0): tether skips their forward, TRL not.
    zero_advantage: list[float] = field(default_factory=list)
    informative_groups: list[int] = field(default_factory=list)  # groups with mixed rewards
    phases: list[dict[str, float]] = field(default_factory=list)  # per step: `PHASES` and other_s

    def add_phases(self, step_s: float, measured: dict[str, float]) -> None:
        """Record a step's phases (`PHASES`, 0 where it had none); `other_s` is the rest of `step_s`,
        so that they sum to it."""
        unknown = set(measured) - set(PHASES)
        assert not unknown, f"unknown phases {sorted(unknown)}"
        phases = {name: measured.get(name, 0.0) for name in PHASES}
        phases["other_s"] = step_s - sum(phases.values())
        self.phases.append(phases)

    def add(self, other: StepTimes, index: int) -> None:
        """Append step `index` of `other` (one timed step of a fresh run)."""
        for name in self.__slots__:
            values = getattr(other, name)
            if values:
                getattr(self, name).append(values[index])

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
            "informative_groups": self.informative_groups[warmup:],
            # The measured steps' phases: each step's sum to its step_s; then each phase's median.
            "steps_phases_s": [{k: round(v, 4) for k, v in p.items()} for p in self.phases[warmup:]],
            "phases_s": {
                name: round(statistics.median(p[name] for p in self.phases[warmup:]), 4)
                for name in (*PHASES, "other_s")
            }
            if self.phases[warmup:]
            else {},
        }


class CpuClock:
    """CPU seconds since the last call."""

    def __init__(self) -> None:
        self.last = time.process_time()

    def lap(self) -> float:
        now = time.process_time()
        spent, self.last = now - self.last, now
        return spent
