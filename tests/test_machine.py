"""The machine record every benchmark shares: load, busy warnings, peak memory."""

from __future__ import annotations

import pytest

from tether import machine


def test_busy_warnings_name_each_load_above_the_benchmarks_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "available_cores", lambda: 2)
    warnings = machine.busy_warnings(1, {"at the start": 0.3, "after dense": 3.5})
    assert len(warnings) == 1 and "after dense: load average 3.50" in warnings[0]


def test_peak_rss_counts_from_its_reset() -> None:
    if not machine.reset_peak_rss():
        pytest.skip("this kernel does not let a process reset its peak RSS")
    assert machine.peak_rss_mib() <= machine.rss_mib() + 1
    block = bytearray(64 * machine.MIB)  # touched: resident
    assert machine.peak_rss_mib() >= machine.rss_mib() - 1 >= 60
    del block
