"""The synthetic trace generator and trace files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tether.errors import ConfigError
from tether.scheduler.job import JobKind
from tether.scheduler.trace import GANG_SHARES, GANG_SIZES, SyntheticTrace, load_trace, save_trace


def test_synthetic_trace_hits_the_offered_load_and_size_mix() -> None:
    jobs = SyntheticTrace(jobs=20_000, seed=1, load=0.8, cluster_accelerators=1024).generate()
    assert len(jobs) == 20_000 and len({j.job_id for j in jobs}) == 20_000
    span = jobs[-1].submit_s - jobs[0].submit_s
    work = sum(j.accelerators * j.duration_s for j in jobs)
    assert work / (span * 1024) == pytest.approx(0.8, rel=0.1)
    gpu_jobs = [j for j in jobs if j.accelerators]
    share_single = sum(j.accelerators == 1 for j in gpu_jobs) / len(gpu_jobs)
    assert share_single == pytest.approx(GANG_SHARES[GANG_SIZES.index(1)], abs=0.04)
    assert max(j.accelerators for j in jobs) == 64
    durations = np.array([j.duration_s for j in gpu_jobs if j.accelerators == 1])
    assert np.median(durations) == pytest.approx(1200, rel=0.15)
    assert sum(j.kind is JobKind.SANDBOX for j in jobs) / len(jobs) == pytest.approx(0.10, abs=0.03)


def test_synthetic_trace_is_reproducible_from_its_seed() -> None:
    assert SyntheticTrace(jobs=50, seed=7).generate() == SyntheticTrace(jobs=50, seed=7).generate()
    assert SyntheticTrace(jobs=50, seed=7).generate() != SyntheticTrace(jobs=50, seed=8).generate()


def test_gangs_never_exceed_a_small_cluster() -> None:
    jobs = SyntheticTrace(jobs=2000, seed=2, cluster_accelerators=16).generate()
    assert max(j.accelerators for j in jobs) <= 16


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [({"jobs": 0}, "at least 1"), ({"load": 0}, "load = 0"), ({"cluster_accelerators": 0}, "accelerator")],
)
def test_bad_synthetic_settings_are_refused(kwargs: dict[str, float], expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        SyntheticTrace(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_traces_round_trip_through_files(tmp_path: Path, suffix: str) -> None:
    jobs = SyntheticTrace(jobs=40, seed=5).generate()
    path = tmp_path / f"trace{suffix}"
    save_trace(jobs, tmp_path / "trace.jsonl")
    if suffix == ".json":
        rows = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
        path.write_text(json.dumps({"jobs": rows}))
    assert load_trace(path) == jobs


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[]", "non-empty list of jobs"),
        ("{not json", "is not valid JSON"),
        ('[{"job_id": "a", "submit_s": 0}]', "job #1: duration_s"),
        ('[{"job_id": "a", "submit_s": -1, "duration_s": 5}]', "submit_s = -1"),
        ('[{"job_id": "a", "submit_s": 0, "duration_s": 5, "gpus": 2}]', "unknown key 'gpus'"),
        ('[{"job_id": "a", "submit_s": 0, "duration_s": 5, "kind": "mining"}]', "kind = 'mining'"),
        ('[{"job_id": "a", "submit_s": 0, "duration_s": 5, "cpus": 0}]', "job a: a replica must ask"),
        ('[{"job_id": "a", "submit_s": 0, "duration_s": 5, "min_replicas": 2}]', "job a: min_replicas = 2"),
        (
            '[{"job_id": "a", "submit_s": 0, "duration_s": 5},'
            ' {"job_id": "a", "submit_s": 1, "duration_s": 5}]',
            "job_id 'a' appears more than once",
        ),
    ],
)
def test_bad_trace_files_name_the_problem(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "trace.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_trace(path)


def test_missing_trace_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_trace(tmp_path / "none.json")
