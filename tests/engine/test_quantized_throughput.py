"""The int8-against-float throughput measurement at toy sizes (the real one: scripts/int8_bench.py on
SmolLM2): both engines decode every stream count, the ratio is theirs, the load is recorded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tether.engine.quantized_throughput import measure_int8_throughput
from tether.testing import make_tiny_model


def test_float_and_int8_engines_are_timed_at_each_stream_count(tmp_path: Path) -> None:
    torch_threads = torch.get_num_threads()
    folder = make_tiny_model(tmp_path / "tiny")
    try:
        report = measure_int8_throughput(folder, [1, 2], new_tokens=3, repeats=1, threads=1, kv_cache_mib=1)
    finally:
        torch.set_num_threads(torch_threads)
    for streams in (1, 2):
        assert report[f"float32_tok_s_{streams}"] > 0 and report[f"int8_tok_s_{streams}"] > 0
        ratio = report[f"int8_tok_s_{streams}"] / report[f"float32_tok_s_{streams}"]
        assert report[f"int8_speedup_{streams}"] == pytest.approx(ratio)
    assert report["machine"]["threads"] == 1 and "load_average_start" in report["machine"]
