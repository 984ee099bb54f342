"""What a sandbox bench records about its machine: CPU, vector extensions, and when it was busy."""

from __future__ import annotations

import pytest

from tether.sandbox.bench_machine import MachineLoad, available_cores, cpu_model, vector_extensions

CPUINFO = """\
processor\t: 0
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_vnni
processor\t: 1
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_vnni
"""


def test_the_cpu_model_and_its_vector_extensions_come_from_cpuinfo() -> None:
    assert cpu_model(CPUINFO) == "AMD EPYC 9R14"
    assert vector_extensions(CPUINFO) == [
        "sse4_2",
        "avx",
        "avx2",
        "fma",
        "avx512f",
        "avx512bw",
        "avx512_vnni",
    ]


def test_a_cpuinfo_without_the_fields_gives_unknown_and_none() -> None:
    assert cpu_model("processor : 0\n") == "unknown"
    assert vector_extensions("") == []


@pytest.mark.parametrize(
    ("start", "end", "busy"),
    [(0.2, 4.5, []), (1.8, 4.5, ["at start"]), (0.1, 6.0, ["at end"]), (7.0, 9.0, ["at start", "at end"])],
)
def test_a_load_beyond_the_benches_own_workers_is_warned_about(
    start: float, end: float, busy: list[str]
) -> None:
    warnings = MachineLoad(workers=4, load_start=start, load_end=end).busy_warnings()
    assert [w.split(":")[0].removeprefix("machine busy ") for w in warnings] == busy
    assert all("4 benchmark worker(s)" in w for w in warnings)


def test_the_machine_info_names_the_workers_and_both_loads() -> None:
    info = MachineLoad(workers=3, load_start=0.5, load_end=2.5).info()
    assert info["threads"] == 3 and info["cores"] == available_cores()
    assert (info["load_average_start"], info["load_average_end"]) == (0.5, 2.5)
