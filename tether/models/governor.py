"""Keep torch's thread count at the cores really free while a long-running engine steps.

`configure_threads` sizes the pool once, at start. Load that arrives later costs far more than a lost
core: with another process busy on one of the 2 cores here, a 64-sequence decode step of SmolLM2 took
281 ms on 2 threads and about 130 ms on 1, because every op's parallel region waits for the thread the
kernel descheduled. The signal is direct: Linux counts, per thread, the time it was runnable but waiting
for a CPU (`/proc/self/task/*/schedstat`, run delay). Measured here, the engine's threads waited 1-2% of
their time on an idle machine and 33-37% with one core taken. So, once per window of stepping:

- our threads waited more than `shrink_wait` of their time: one thread fewer;
- a whole core stood idle (`/proc/stat`) while we ran: one thread more, up to the cores we may use.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tether.models.threads import available_cores, idle_cores, read_cpu_times

TASKS = Path("/proc/self/task")


@dataclass(frozen=True, slots=True)
class GovernorConfig:
    window_s: float = 2.0
    """Seconds between two decisions."""
    shrink_wait: float = 0.2
    """Give up a thread when ours waited for a CPU more than this fraction of the window."""
    grow_idle_cores: float = 0.75
    """Take a thread back when at least this many cores stood idle over the window."""

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s!r}")
        if not 0 < self.shrink_wait < 1:
            raise ValueError(f"shrink_wait must be between 0 and 1, got {self.shrink_wait!r}")
        if not 0 < self.grow_idle_cores <= 1:
            raise ValueError(f"grow_idle_cores must be in (0, 1], got {self.grow_idle_cores!r}")


def decide(threads: int, max_threads: int, wait_fraction: float, idle: float, config: GovernorConfig) -> int:
    """The thread count for the next window, one step at a time within [1, max_threads]."""
    if wait_fraction > config.shrink_wait and threads > 1:
        return threads - 1
    if idle >= config.grow_idle_cores and threads < max_threads:
        return threads + 1
    return min(max(threads, 1), max_threads)


def run_delay_s(tasks: Path = TASKS) -> float | None:
    """Seconds this process's threads have spent runnable but not running; None without schedstat."""
    total_ns = 0
    try:
        entries = list(tasks.iterdir())
    except OSError:
        return None
    for task in entries:
        try:
            total_ns += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total_ns / 1e9


class ThreadGovernor:
    """Call `observe` from the thread that runs the model, once per step: it reads the counters once per
    window and moves torch's thread count (that thread's) by one when the window says so."""

    def __init__(
        self,
        config: GovernorConfig | None = None,
        max_threads: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        read_delay: Callable[[], float | None] = run_delay_s,
        read_cpu: Callable[[], tuple[int, int] | None] = read_cpu_times,
        cores: int | None = None,
    ) -> None:
        self.config = config or GovernorConfig()
        self.max_threads = max_threads or available_cores()
        self.cores = cores or os.cpu_count() or 1
        self.clock = clock
        self.read_delay = read_delay
        self.read_cpu = read_cpu
        self.changes = 0
        """Thread-count changes so far (exported by the engine's metrics)."""
        self._since = clock()
        self._delay = read_delay()
        self._cpu = read_cpu()

    def observe(self) -> int:
        """The thread count to run with now (changed at most once per window)."""
        threads = torch.get_num_threads()
        now = self.clock()
        wall = now - self._since
        if wall < self.config.window_s:
            return threads
        delay, cpu = self.read_delay(), self.read_cpu()
        if delay is not None and cpu is not None and self._delay is not None and self._cpu is not None:
            wait_fraction = max(0.0, delay - self._delay) / (wall * threads)
            idle = idle_cores(self._cpu, cpu, self.cores)
            chosen = decide(threads, self.max_threads, wait_fraction, idle, self.config)
            if chosen != threads:
                torch.set_num_threads(chosen)
                self.changes += 1
                threads = chosen
        self._since, self._delay, self._cpu = now, delay, cpu
        return threads
