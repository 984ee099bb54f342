"""The busy-start benchmark: the demo's training phase started beside a CPU hog that leaves after its first
minute, against the same phase on an idle machine, in one process.

A run sizes its threads at start from the cores free then (`configure_threads`, as `tether demo` does), so
one started beside the hog begins on fewer threads; following the free cores (`cores.py`) it takes them
back once the hog has gone. `busy_start_speed_ratio` is the idle phase's wall time over the busy-start
phase's (goal >= 0.8). Only the training phase (`Trainer.run`) is timed: loading and evaluation are not
what the hog slows. On a machine other work shares the figure is indicative, so the load average, the
CPU and each step's thread count go beside it. It prints nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tether.engine.bench_machine import machine_info
from tether.envs.context import SandboxProvider
from tether.envs.registry import EnvRegistry
from tether.machine import busy_warnings, load_average
from tether.models.threads import configure_threads
from tether.rl.builders import build_trainer
from tether.rl.config import TrainConfig
from tether.rl.trainer import Metrics

HOG = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"
"""A process that keeps one core busy until it is killed."""


@dataclass(frozen=True, slots=True)
class BusyStartConfig:
    train: TrainConfig
    """The run to time twice (the demo's `[run]`/`[rollout]` sections, maybe with fewer steps)."""
    hog_s: float = 60.0
    """Seconds the hog spins after the busy-start phase's training begins."""

    def __post_init__(self) -> None:
        if not self.hog_s > 0:
            raise ValueError(f"hog_s must be > 0, got {self.hog_s!r}")


@dataclass(frozen=True, slots=True)
class ThreadSample:
    """Where the thread count stood when a step ended."""

    t_s: float  # since the training phase began
    step: int
    threads: int
    changes: int
    decisions: int  # windows of load the governor had weighed by then


@dataclass(slots=True)
class PhaseResult:
    """One timed training phase."""

    wall_s: float = 0.0
    threads_at_start: int = 0  # what `configure_threads` chose from the cores free at the start
    hog_stopped_s: float | None = None  # when the hog was killed, since the training phase began
    load_average_start: float = 0.0
    load_average_end: float = 0.0
    threads: list[ThreadSample] = field(default_factory=list)

    def redecided_after_hog(self) -> bool:
        """Whether the governor weighed a window of load that began after the hog had gone."""
        if self.hog_stopped_s is None:
            return False
        before = [s.decisions for s in self.threads if s.t_s <= self.hog_stopped_s]
        after = [s.decisions for s in self.threads if s.t_s > self.hog_stopped_s]
        return bool(after) and after[-1] > (before[-1] if before else 0) + 1


class Hog:
    """A process spinning on one core; `stop` (from any thread) kills it and notes when."""

    def __init__(self, core: int) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", HOG, str(core)])
        self.stopped_at: float | None = None
        self._lock = threading.Lock()

    def stop(self) -> None:
        with self._lock:
            if self.stopped_at is None:
                self.process.kill()
                self.process.wait()
                self.stopped_at = time.monotonic()


def hog_core() -> int:
    """The core the hog takes: the lowest of those this process may run on."""
    return min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0


def train_phase(
    config: TrainConfig,
    hog_s: float | None,
    sandbox: SandboxProvider | None = None,
    registry: EnvRegistry | None = None,
) -> PhaseResult:
    """Size the threads as `tether demo` does, build the trainer and time its run; with `hog_s`, beside a
    hog started before the threads are sized and killed `hog_s` after the training began."""
    result = PhaseResult(load_average_start=load_average())
    hog = Hog(hog_core()) if hog_s is not None else None
    timer: threading.Timer | None = None
    try:
        if hog is not None:
            time.sleep(0.5)  # the hog's interpreter is up and spinning before the cores are sampled
        result.threads_at_start = configure_threads()
        trainer = build_trainer(config, registry=registry, sandbox=sandbox)
        try:
            start = time.monotonic()
            if hog is not None and hog_s is not None:
                timer = threading.Timer(hog_s, hog.stop)
                timer.start()

            def on_step(metrics: Metrics) -> None:
                sample = ThreadSample(
                    t_s=round(time.monotonic() - start, 3),
                    step=int(metrics["step"]),
                    threads=int(metrics["run/threads"]),
                    changes=int(metrics["run/threads_changes"]),
                    decisions=trainer.threads.decisions,
                )
                result.threads.append(sample)

            trainer.run(on_step, final_checkpoint=False)
            result.wall_s = time.monotonic() - start
        finally:
            trainer.close()
        if hog is not None and hog.stopped_at is not None:
            result.hog_stopped_s = round(hog.stopped_at - start, 3)
    finally:
        if timer is not None:
            timer.cancel()
        if hog is not None:
            hog.stop()
    result.load_average_end = load_average()
    return result


def run_busy_start(
    config: BusyStartConfig,
    sandbox: Callable[[], SandboxProvider | None] = lambda: None,
    registry: EnvRegistry | None = None,
) -> dict[str, Any]:
    """The idle phase, then the busy-start phase, of `config.train` (each a run directory of its own
    under `run.out_dir`); `sandbox` makes each phase's sandbox provider. Returns the report."""
    train = config.train
    phases: dict[str, PhaseResult] = {}
    for name, hog_s in (("idle", None), ("busy_start", config.hog_s)):
        run = train.run.model_copy(update={"name": f"{train.run.name}-{name}"})
        phases[name] = train_phase(train.model_copy(update={"run": run}), hog_s, sandbox(), registry)
    idle, busy = phases["idle"], phases["busy_start"]
    loads = {"at the idle phase's start": idle.load_average_start, "at the end": busy.load_average_end}
    return {
        "busy_start_speed_ratio": round(idle.wall_s / max(busy.wall_s, 1e-9), 4),
        "redecided_after_hog": busy.redecided_after_hog(),
        "hog_s": config.hog_s,
        "steps": train.run.steps,
        "mode": train.run.mode.value,
        "model": train.model.name,
        "phases": {name: asdict(phase) for name, phase in phases.items()},
        "machine": machine_info(idle.threads_at_start, idle.load_average_start),
        "warnings": busy_warnings(idle.threads_at_start, loads),
    }
