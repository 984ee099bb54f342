"""The start-up benchmark: commands timed end to end against their baselines, in one run."""

from __future__ import annotations

import sys

import pytest

from tether.sandbox.startup_bench import StartupBenchmarkFailed, run_startup_benchmark, timed


def test_one_round_without_humaneval_reports_the_run_against_python() -> None:
    result = run_startup_benchmark(repeats=1, humaneval=False)
    python_s, run_s = float(str(result["python_print_s"])), float(str(result["sandbox_run_s"]))
    assert 0 < python_s < run_s < 60
    # The ratio is of the unrounded medians, the times are rounded.
    assert result["sandbox_run_over_python"] == pytest.approx(run_s / python_s, rel=0.05)
    assert "humaneval_speedup_vs_harness" not in result
    assert isinstance(result["machine"], dict) and isinstance(result["machine"]["busy_warnings"], list)


def test_a_failing_command_is_an_error_naming_it_not_a_time() -> None:
    with pytest.raises(StartupBenchmarkFailed, match="exited 3"):
        timed([sys.executable, "-c", "import sys; sys.exit(3)"])


@pytest.mark.slow
def test_sandbox_commands_meet_their_start_up_goals() -> None:
    result = run_startup_benchmark(repeats=5)
    assert float(str(result["sandbox_run_s"])) < 0.5, result
    assert float(str(result["humaneval_speedup_vs_harness"])) >= 3, result
