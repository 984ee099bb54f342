"""`tether eval` outputs in a run root are runs of kind `eval`: listed with their status, a page with the
per-domain summary and the episodes (filtered like transcripts), and no curves to stream."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from fastapi.testclient import TestClient

from tether.console.app import create_app
from tether.console.config import ConsoleConfig
from tether.envs.scoring import Score
from tether.eval.runner import EpisodeRecord
from tether.eval.summary import summarise

NAME = "eval-20261203-101500-4242"


def _records() -> list[EpisodeRecord]:
    made = []
    for seed in range(6):
        env = "math/arithmetic" if seed % 2 else "code/python"
        right = seed % 3 != 0
        score = Score(
            total=1.0 if right else 0.0,
            components={"correct": float(right)},
            weights={"correct": 1.0},
            passed=right,
            qc_violation="deleted a protected file" if seed == 4 else None,
        )
        made.append(
            EpisodeRecord(
                env=env,
                seed=seed,
                reference="391",
                score=score,
                turns=1,
                completion_tokens=12,
                transcript=[
                    {"role": "user", "content": f"question {seed}"},
                    {"role": "assistant", "content": f"answer {seed}"},
                ],
            )
        )
    return made


def write_eval(root: Path, finished: bool) -> Path:
    """What `tether eval --out-dir root` writes: the episodes, then (when done) the summary."""
    records = _records()
    episodes = root / f"{NAME}.jsonl"
    episodes.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    if finished:
        summary = {
            "model": "tiny",
            "episodes": len(records),
            "mean_reward": sum(r.reward for r in records) / len(records),
            "pass_rate": sum(bool(r.score and r.score.passed) for r in records) / len(records),
            "errors": 0,
            "domains": [row.to_dict() for row in summarise(records)],
        }
        episodes.with_suffix(".json").write_text(json.dumps(summary))
    return episodes


def test_a_finished_eval_is_listed_with_its_mean_reward(tmp_path: Path) -> None:
    write_eval(tmp_path, finished=True)
    runs = TestClient(create_app(ConsoleConfig(runs=(tmp_path,)))).get("/api/runs").json()["runs"]
    assert [(r["name"], r["kind"], r["status"], r["step"]) for r in runs] == [(NAME, "eval", "finished", 6)]
    assert runs[0]["reward"] == 4 / 6


def test_an_eval_that_died_before_its_summary_is_failed(tmp_path: Path) -> None:
    episodes = write_eval(tmp_path, finished=False)
    client = TestClient(create_app(ConsoleConfig(runs=(tmp_path,))))
    assert client.get(f"/api/runs/{NAME}").json()["status"] == "running"
    then = time.time() - 3600
    os.utime(episodes, (then, then))
    assert client.get(f"/api/runs/{NAME}").json()["status"] == "failed"


def test_the_eval_page_shows_domains_and_filters_its_episodes(tmp_path: Path) -> None:
    write_eval(tmp_path, finished=True)
    client = TestClient(create_app(ConsoleConfig(runs=(tmp_path,))))
    page = client.get(f"/runs/{NAME}").text
    assert 'id="eval-domains"' in page and "math/arithmetic" in page and "answer 5" in page
    violations = client.get(f"/api/runs/{NAME}/transcripts?qc=violations").json()
    assert [t["seed"] for t in violations["transcripts"]] == [4]
    math = client.get(f"/api/runs/{NAME}/transcripts?domain=math/arithmetic&min_reward=1").json()
    assert [t["seed"] for t in math["transcripts"]] == [5, 1]
    assert client.get(f"/api/runs/{NAME}/transcripts?domain=nope").status_code == 400


def test_an_eval_has_no_curves_to_stream(tmp_path: Path) -> None:
    write_eval(tmp_path, finished=True)
    client = TestClient(create_app(ConsoleConfig(runs=(tmp_path,))))
    for path in (f"/api/runs/{NAME}/series", f"/api/runs/{NAME}/events"):
        answer = client.get(path)
        assert answer.status_code == 400
        assert "tether eval" in answer.json()["error"]["message"]
