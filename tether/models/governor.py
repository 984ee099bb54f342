"""Keep torch's thread count at the cores really free while a long-running engine or trainer steps.

`configure_threads` sizes the pool once, at start. Load that arrives later costs far more than a lost
core: with another process busy on one of the 2 cores here, a 64-sequence decode step of SmolLM2 took
281 ms on 2 threads and about 130 ms on 1, because every op's parallel region waits for the thread the
kernel descheduled. And load that leaves costs the other way: `make demo` started beside a busy core kept
1 thread for its whole run. The signal is direct: Linux counts, per thread, the time it was runnable but
waiting for a CPU (`/proc/self/task/*/schedstat`, run delay). Measured here, the engine's threads waited
1-2% of their time on an idle machine and 33-37% with one core taken. So, once per window:

- our threads waited more than `shrink_wait` of their time for `shrink_windows` windows: one thread fewer;
- a whole core stood idle (`/proc/stat`) for `grow_windows` windows in a row: one thread more, up to the
  cores we may use.

The hysteresis is in the thresholds (waiting is not the opposite of idle: a busy machine where we do not
wait holds) and in the windows: only windows observed at the current count speak for it, so load that
comes and goes every window costs a thread once and does not take it back until it stays away.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tether.models.threads import available_cores, idle_cores, read_cpu_times

TASKS = Path("/proc/self/task")


@dataclass(frozen=True, slots=True)
class GovernorConfig:
    window_s: float = 2.0
    """Seconds between two decisions (at least: a caller observing less often makes its windows longer)."""
    shrink_wait: float = 0.2
    """Give up a thread when ours waited for a CPU more than this fraction of the window."""
    grow_idle_cores: float = 0.75
    """Take a thread back when at least this many cores stood idle over the window."""
    shrink_windows: int = 1
    """Windows in a row that must wait before a thread goes: one, since oversubscription halves speed."""
    grow_windows: int = 2
    """Windows in a row with an idle core before a thread comes back: a lone quiet window is no sign."""

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s!r}")
        if not 0 < self.shrink_wait < 1:
            raise ValueError(f"shrink_wait must be between 0 and 1, got {self.shrink_wait!r}")
        if not 0 < self.grow_idle_cores <= 1:
            raise ValueError(f"grow_idle_cores must be in (0, 1], got {self.grow_idle_cores!r}")
        for name in ("shrink_windows", "grow_windows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")

    @property
    def history_windows(self) -> int:
        """Windows a decision looks back over."""
        return max(self.shrink_windows, self.grow_windows)


@dataclass(frozen=True, slots=True)
class Window:
    """What one window saw: how much our threads waited for a CPU, and how many cores stood idle."""

    wait_fraction: float
    """Run delay of our threads over (window x threads): 0 never waited, 1 never ran."""
    idle_cores: float
    """Cores of the machine idle over the window."""


def decide(threads: int, max_threads: int, windows: Sequence[Window], config: GovernorConfig) -> int:
    """The thread count after `windows` (oldest first), all observed at `threads`: one step at a time
    within [1, max_threads], and only when the last `shrink_windows` or `grow_windows` agree."""
    current = min(max(threads, 1), max_threads)
    shrink = windows[-config.shrink_windows :] if len(windows) >= config.shrink_windows else ()
    if shrink and all(w.wait_fraction > config.shrink_wait for w in shrink) and current > 1:
        return current - 1
    grow = windows[-config.grow_windows :] if len(windows) >= config.grow_windows else ()
    quiet = all(
        w.idle_cores >= config.grow_idle_cores and w.wait_fraction <= config.shrink_wait for w in grow
    )
    if grow and quiet and current < max_threads:
        return current + 1
    return current


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
    """Call `observe` once per step of the work it governs: it reads the counters once per window and
    moves the count by one when its windows say so. By default it sets torch's thread count on the
    calling thread (an engine's stepping thread); `apply=None` only keeps the count, for a caller that
    splits it between threads itself (the async trainer's rollout and learner threads). Safe to call from
    several threads."""

    def __init__(
        self,
        config: GovernorConfig | None = None,
        max_threads: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        read_delay: Callable[[], float | None] = run_delay_s,
        read_cpu: Callable[[], tuple[int, int] | None] = read_cpu_times,
        cores: int | None = None,
        threads: int | None = None,
        apply: Callable[[int], None] | None = torch.set_num_threads,
    ) -> None:
        self.config = config or GovernorConfig()
        self.max_threads = max_threads or available_cores()
        self.cores = cores or os.cpu_count() or 1
        self.clock = clock
        self.read_delay = read_delay
        self.read_cpu = read_cpu
        self.apply = apply
        self.threads = min(max(threads or torch.get_num_threads(), 1), self.max_threads)
        """The count chosen now."""
        self.changes = 0
        """Thread-count changes so far (exported by the engine's and the trainer's metrics)."""
        self.decisions = 0
        """Windows decided so far, whether or not they changed the count."""
        self._lock = threading.Lock()
        self._windows: list[Window] = []  # observed at the current count, oldest first
        self._since = clock()
        self._delay = read_delay()
        self._cpu = read_cpu()

    def observe(self) -> int:
        """The thread count to run with now (changed at most once per window)."""
        with self._lock:
            if self.apply is not None:  # the thread's own count is the truth (a caller may have set it)
                self.threads = torch.get_num_threads()
            now = self.clock()
            wall = now - self._since
            if wall < self.config.window_s:
                return self.threads
            delay, cpu = self.read_delay(), self.read_cpu()
            if delay is not None and cpu is not None and self._delay is not None and self._cpu is not None:
                wait_fraction = max(0.0, delay - self._delay) / (wall * self.threads)
                window = Window(wait_fraction, idle_cores(self._cpu, cpu, self.cores))
                self._windows = [*self._windows, window][-self.config.history_windows :]
                chosen = decide(self.threads, self.max_threads, self._windows, self.config)
                self.decisions += 1
                if chosen != self.threads:
                    self.threads = chosen
                    self.changes += 1
                    self._windows = []  # they were observed at the old count
                    if self.apply is not None:
                        self.apply(chosen)
            self._since, self._delay, self._cpu = now, delay, cpu
            return self.threads
