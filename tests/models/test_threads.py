"""Thread sizing counts the cores idle now, read from /proc/stat."""

from __future__ import annotations

import os

import pytest
import torch

from tether.models.threads import configure_threads, cpu_times, idle_cores, strict_matmul

STAT = """cpu  100 0 50 800 50 0 0 0 0 0
cpu0 50 0 25 400 25 0 0 0 0 0
cpu1 50 0 25 400 25 0 0 0 0 0
intr 12345
"""


def test_cpu_times_reads_idle_and_iowait_from_the_aggregate_line() -> None:
    assert cpu_times(STAT) == (850, 1000)


def test_a_stat_without_an_aggregate_line_is_refused() -> None:
    with pytest.raises(ValueError, match="no aggregate 'cpu' line"):
        cpu_times("cpu0 1 2 3 4\n")


@pytest.mark.parametrize(
    ("before", "after", "idle"),
    [
        ((0, 0), (100, 100), 2.0),  # both cores idle
        ((0, 0), (50, 100), 1.0),  # one busy
        ((0, 0), (0, 100), 0.0),  # both busy
        ((10, 10), (10, 10), 2.0),  # no time passed: assume idle
    ],
)
def test_idle_cores_scales_the_idle_share_by_the_core_count(
    before: tuple[int, int], after: tuple[int, int], idle: float
) -> None:
    assert idle_cores(before, after, 2) == idle


def test_configure_threads_sets_at_least_one_and_honours_the_cap() -> None:
    previous = torch.get_num_threads()
    try:
        assert configure_threads(max_threads=1) == 1 == torch.get_num_threads()
        assert configure_threads(reserved_cores=64) == 1
        with pytest.raises(ValueError, match="reserved_cores must be >= 0"):
            configure_threads(reserved_cores=-1)
    finally:
        torch.set_num_threads(previous)


def test_strict_matmul_asks_mkl_for_strict_mode_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MKL_CBWR", raising=False)
    assert strict_matmul() is True
    assert os.environ["MKL_CBWR"] == "AUTO,STRICT"
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    assert strict_matmul() is False  # a user's own setting wins, and is reported as not strict
    assert os.environ["MKL_CBWR"] == "COMPATIBLE"
