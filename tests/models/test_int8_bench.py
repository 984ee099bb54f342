"""The int8 projection micro-benchmark at toy sizes (the real one: scripts/int8_bench.py): every shape,
row count and mode gets its three timings and ratios, with the machine's state beside them."""

from __future__ import annotations

from tether.models.int8_bench import run_matmul_bench


def test_every_shape_and_row_count_is_timed_for_float_and_both_int8_paths() -> None:
    report = run_matmul_bench(
        {"toy": (40, 24)}, [1, 3], repeats=2, streamed=[False, True], streamed_bytes=1 << 16
    )
    timings = report["timings"]
    assert isinstance(timings, list) and len(timings) == 4
    assert {(t["rows"], t["streamed"]) for t in timings} == {(1, False), (3, False), (1, True), (3, True)}
    for timing in timings:
        assert timing["float_us"] > 0 and timing["old_int8_us"] > 0 and timing["int8_us"] > 0
        assert timing["int8_speedup"] == timing["float_us"] / timing["int8_us"]
    assert report["threads"] >= 1 and len(report["load_average"]) == 3  # type: ignore[arg-type]
    assert report["int8_kernel"] in {"AVX512", "AVX2", "PORTABLE"}
