"""The machine record every benchmark shares: load, busy warnings, peak memory."""

from __future__ import annotations

import io

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


AVX512_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "amx_tile"})


@pytest.mark.parametrize(
    ("flags", "families"),
    [
        (AVX512_FLAGS, ["AVX2", "AVX-512", "AMX"]),
        (frozenset({"sse4_2", "avx", "avx2", "fma"}), ["AVX2"]),
        (frozenset({"asimd"}), ["NEON"]),
        (frozenset(), []),
    ],
)
def test_vector_families_name_the_extensions_a_figure_depends_on(
    flags: frozenset[str], families: list[str]
) -> None:
    assert machine.vector_families(flags) == families


def test_a_busy_machine_is_flagged_and_warned_on_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "available_cores", lambda: 2)
    monkeypatch.setattr(machine, "load_average", lambda: 4.0)
    record = machine.machine_record(2, 0.2, {"after warm-up": 0.4})
    assert record["busy"] and record["load_average_start"] == 0.2 and record["load_average_end"] == 4.0
    assert [w.split(":")[0] for w in record["busy_warnings"]] == ["machine busy at the end"]
    stream = io.StringIO()
    machine.warn_if_busy(record, stream)
    assert stream.getvalue().startswith("warning: machine busy at the end: load average 4.00")


def test_an_idle_machine_is_not_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "load_average", lambda: 0.1)
    record = machine.machine_record(1, 0.1)
    assert not record["busy"] and record["busy_warnings"] == [] and record["threads"] == 1
    assert record["cores"] >= 1 and isinstance(record["cpu"], str)
    stream = io.StringIO()
    machine.warn_if_busy(record, stream)
    assert stream.getvalue() == ""
