"""Acceptance: two RL jobs on a machine told it has 2 accelerators get one device each; a higher-priority
job preempts one (SIGTERM: it finishes its step and checkpoints), runs on its device, and the preempted
job resumes from its checkpoint and ends exactly where an uninterrupted run of its config ends."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tether.cli.main import app
from tether.scheduler.job import JobState
from tether.scheduler.local import LocalBackend
from tether.scheduler.store import JobRecord

runner = CliRunner()
# Wall-clock figures, and the threads each run took of the cores the other left free, differ between runs.
VOLATILE = ("time/", "tokens_per_s", "run/threads")
STEPS = 60  # enough training (about 6 s) that both low jobs are mid-run when the urgent one comes


def _config(path: Path, model: Path, out_dir: Path, name: str, steps: int = STEPS) -> Path:
    path.write_text(
        f"""
[model]
name = "{model}"
kv_cache_mib = 8

[envs.weights]
"math/arithmetic" = 1.0

[rollout]
prompts_per_step = 2
samples_per_prompt = 2
max_new_tokens = 4

[optim]
lr = 1e-3

[run]
name = "{name}"
out_dir = "{out_dir}"
steps = {steps}
checkpoint_every = 1000
seed = 3
"""
    )
    return path


def _submit(db: Path, *args: str) -> int:
    result = runner.invoke(
        app, ["jobs", "--machine-accelerators", "2", "submit", "--db", str(db), "--json", *args]
    )
    assert result.exit_code == 0, result.output
    return int(json.loads(result.output)["id"])


def _wait(
    backend: LocalBackend, job_id: int, done: Callable[[JobRecord], bool], timeout_s: float
) -> JobRecord:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = backend.get(job_id)
        if done(record):
            return record
        time.sleep(0.1)
    raise AssertionError(
        f"job {job_id} stuck: {backend.get(job_id)}\n{Path(backend.get(job_id).log_path).read_text()}"
    )


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _stable(metrics: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}


def _visible_devices(pid: int) -> str:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e for e in environ if e.startswith(b"CUDA_VISIBLE_DEVICES=")).split(b"=", 1)[1].decode()


def _weights_digest(run_dir: Path) -> str:
    """The final checkpoint's tensor data (its `.metadata` names the writer, which differs per run)."""
    step = run_dir / "checkpoints" / f"step-{STEPS:06d}" / "state"
    digest = hashlib.sha256()
    for file in sorted(step.glob("*.distcp")):
        digest.update(file.relative_to(step).as_posix().encode() + file.read_bytes())
    return digest.hexdigest()


def test_preempted_train_job_resumes_from_its_checkpoint_and_matches_an_uninterrupted_run(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # jobs and the reference run alike
    monkeypatch.chdir(tmp_path)
    model, runs, db = tiny_model("llama"), tmp_path / "runs", tmp_path / "jobs.sqlite"
    low = [
        _submit(
            db,
            "--policy",
            "priority",
            "--accelerators",
            "1",
            "--preemptible",
            "--",
            "tether",
            "train",
            "--config",
            str(_config(tmp_path / f"{name}.toml", model, runs, name)),
        )
        for name in ("a", "b")
    ]
    backend = LocalBackend.open(db)
    assert backend.capacity.accelerators == 2  # remembered from --machine-accelerators
    records = [_wait(backend, i, lambda r: r.child_pgid is not None, 30) for i in low]
    assert sorted(_visible_devices(r.child_pgid or 0) for r in records) == ["0", "1"]
    assert sorted(r.devices for r in records) == [(0,), (1,)]
    for name in ("a", "b"):  # both are training (past start-up) when the urgent job arrives
        deadline = time.monotonic() + 60
        while not _lines(runs / name / "metrics.jsonl") and time.monotonic() < deadline:
            time.sleep(0.1)

    urgent = _submit(
        db,
        "--accelerators",
        "1",
        "--priority",
        "10",
        "--",
        "tether",
        "train",
        "--config",
        str(_config(tmp_path / "h.toml", model, runs, "h", steps=2)),
    )
    started = _wait(backend, urgent, lambda r: r.state is JobState.RUNNING, 60)
    victim_id = next(i for i in low if backend.get(i).preemptions == 1)
    victim_dir = runs / ("a" if victim_id == low[0] else "b")
    # SIGTERM finished the step in flight and checkpointed it; the urgent job got the victim's device.
    stopped_at = len(_lines(victim_dir / "metrics.jsonl"))
    assert 1 <= stopped_at < STEPS
    assert (victim_dir / "checkpoints" / f"step-{stopped_at:06d}").is_dir()
    assert started.devices == records[low.index(victim_id)].devices

    for job_id in (*low, urgent):
        assert (
            _wait(backend, job_id, lambda r: r.state in (JobState.DONE, JobState.FAILED), 120).state
            is JobState.DONE
        )
    resumed = backend.get(victim_id)
    assert (resumed.attempts, resumed.preemptions, resumed.resumes) == (2, 1, 1)
    assert "--resume" in Path(resumed.log_path).read_text()

    # The other low job ran the same config uninterrupted: the resumed run must end exactly like it.
    other_dir = runs / ("b" if victim_dir.name == "a" else "a")
    assert backend.get(low[1 - low.index(victim_id)]).preemptions == 0
    got, expected = _lines(victim_dir / "metrics.jsonl"), _lines(other_dir / "metrics.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in expected] == list(range(1, STEPS + 1))
    assert [_stable(m) for m in got] == [_stable(m) for m in expected]
    texts = [(t["step"], t["prompt"], t["text"]) for t in _lines(victim_dir / "transcripts.jsonl")]
    assert texts == [(t["step"], t["prompt"], t["text"]) for t in _lines(other_dir / "transcripts.jsonl")]
    assert _weights_digest(victim_dir) == _weights_digest(other_dir)
