"""`tether models pull/list/doctor` as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tether.cli.models import app
from tether.kernels import cpu
from tether.kernels.cpu import CpuFeature

SMOLLM2 = "smollm2-135m-instruct"

runner = CliRunner()


def test_pull_prints_the_folder_and_list_shows_it(smollm2_folder: Path, model_cache: Path) -> None:
    pulled = runner.invoke(app, ["pull", SMOLLM2, "--cache-dir", str(model_cache)])
    assert pulled.exit_code == 0, pulled.output
    assert str(smollm2_folder) in pulled.stdout
    listed = runner.invoke(app, ["list", "--json", "--cache-dir", str(model_cache)])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.stdout)
    assert [(r["name"], r["architecture"]) for r in rows] == [(SMOLLM2, "LlamaForCausalLM")]
    table = runner.invoke(app, ["list", "--cache-dir", str(model_cache)])
    assert SMOLLM2 in table.stdout


def test_pull_of_an_unknown_model_exits_non_zero_naming_it(tmp_path: Path) -> None:
    result = runner.invoke(app, ["pull", "gpt-17", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "gpt-17" in result.output
    assert SMOLLM2 in result.output


@pytest.mark.parametrize(
    ("features", "float32", "bfloat16"),
    [
        (
            {CpuFeature.AVX2_FMA, CpuFeature.ONEDNN, CpuFeature.ONEDNN_BF16},
            ("oneDNN, prepacked weights", "C kernel, AVX2"),
            ("oneDNN, prepacked weights", "torch SDPA"),
        ),
        (
            {CpuFeature.AVX2_FMA, CpuFeature.ONEDNN},  # an AMD EPYC without AVX-512
            ("oneDNN, prepacked weights", "C kernel, AVX2"),
            ("torch F.linear (MKL)", "torch SDPA"),
        ),
        (set(), ("torch F.linear (MKL)", "C kernel, portable"), ("torch F.linear (MKL)", "torch SDPA")),
    ],
    ids=["avx512", "avx2-only", "none"],
)
def test_doctor_names_the_kernel_path_each_dtype_takes(
    monkeypatch: pytest.MonkeyPatch,
    features: set[CpuFeature],
    float32: tuple[str, str],
    bfloat16: tuple[str, str],
) -> None:
    monkeypatch.setattr(cpu, "detected", lambda: frozenset(features))
    result = runner.invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["features"] == {feature.value: feature in features for feature in CpuFeature}
    for dtype, (projections, attention) in (("float32", float32), ("bfloat16", bfloat16)):
        assert report["kernels"][dtype] == {"projections": projections, "decode_attention": attention}
    table = runner.invoke(app, ["doctor"], terminal_width=200)
    assert table.exit_code == 0 and f"float32  │ {float32[0]}" in table.stdout


def test_doctor_reports_this_cpus_own_features() -> None:
    report = json.loads(runner.invoke(app, ["doctor", "--json"]).stdout)
    assert report["features"] == {feature.value: feature in cpu.detected() for feature in CpuFeature}


@pytest.mark.parametrize(
    ("features", "path"),
    [
        ({CpuFeature.AVX2_FMA, CpuFeature.AVX512F}, "AVX512"),
        ({CpuFeature.AVX2_FMA}, "AVX2"),
        (set(), "PORTABLE"),
    ],
)
def test_doctor_names_the_int8_weight_kernels_path(
    monkeypatch: pytest.MonkeyPatch, features: set[CpuFeature], path: str
) -> None:
    monkeypatch.setattr(cpu, "detected", lambda: frozenset(features))
    report = json.loads(runner.invoke(app, ["doctor", "--json"]).stdout)
    assert report["kernels"]["int8"]["projections"] == f"int8 weight kernel, {path}"


@pytest.mark.parametrize(
    ("features", "path"),
    [
        ({CpuFeature.AVX2_FMA, CpuFeature.AVX512F, CpuFeature.AVX512_VNNI}, "VNNI"),
        ({CpuFeature.AVX2_FMA, CpuFeature.AVX512F}, "AVX2"),
        (set(), "PORTABLE"),
    ],
)
def test_doctor_names_the_dynamic_int8_kernels_path(
    monkeypatch: pytest.MonkeyPatch, features: set[CpuFeature], path: str
) -> None:
    monkeypatch.setattr(cpu, "detected", lambda: frozenset(features))
    report = json.loads(runner.invoke(app, ["doctor", "--json"]).stdout)
    assert report["kernels"]["w8a8"]["projections"] == f"dynamic int8 kernel, {path}"
