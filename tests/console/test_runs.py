"""The runs pages over run directories: status read from the trainer's files, the transcript filter, the
series and every bad input answered 4xx (TestClient; the browser tests are in test_runs_browser.py)."""

from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tether.console.app import create_app
from tether.console.config import ConsoleConfig
from tether.console.run_charts import MAX_POINTS, chart_plans
from tether.console.run_reader import RunStatus, list_runs
from tether.models.checkpoints import LATEST
from tether.rl.config import dump_config, parse_config
from tether.rl.cost import COST_FILE
from tether.rl.metrics import domain_metrics, staleness
from tether.rl.report import EVALUATION
from tether.rl.rollout import Rollout

DOMAINS = {"math/arithmetic": ("correct", "format"), "code/python": ("tests", "style")}
PROMPTS = {"math/arithmetic": "What is 17 * 23?", "code/python": "Write fizzbuzz(n) in Python."}
ANSWERS = {  # (wrong, right)
    "math/arithmetic": (
        "17 * 23 = 17 * 20 + 17 * 3 = 340 + 41 = 381",
        "17 * 23 = 17 * 20 + 17 * 3 = 340 + 51 = 391",
    ),
    "code/python": (
        "def fizzbuzz(n):\n    return 'Fizz' if n % 3 == 0 else str(n)",
        "def fizzbuzz(n):\n    return 'Fizz' * (n % 3 == 0) + 'Buzz' * (n % 5 == 0) or str(n)",
    ),
}


def _rollouts(step: int, rng: random.Random, per_domain: int = 4) -> list[Rollout]:
    """Rollouts whose rewards climb with the step, scored like an environment with two components."""
    made = []
    for index, (env, (first, second)) in enumerate(DOMAINS.items()):
        skill = 1 - math.exp(-step / (150 + 100 * index))
        for seed in range(per_domain):
            parts = {
                first: float(rng.random() < 0.15 + 0.7 * skill),
                second: min(1.0, 0.5 + skill * rng.random()),
            }
            tokens = int(40 + 60 * (1 - skill) + rng.randint(0, 20))
            made.append(
                Rollout(
                    env=env,
                    seed=step * 100 + seed,
                    group=seed,
                    prompt_ids=[1] * 12,
                    completion_ids=[2] * tokens,
                    logprobs=[-0.5] * tokens,
                    versions=[step - 1] * tokens,
                    finish_reason="length" if tokens >= 96 else "stop",
                    text=ANSWERS[env][int(parts[first])],
                    reward=0.7 * parts[first] + 0.3 * parts[second],
                    components=parts,
                    passed=parts[first] == 1.0,
                    qc_violation="wrote a protected file" if rng.random() < 0.03 else None,
                )
            )
    return made


def metrics_row(step: int, rng: random.Random) -> dict[str, float]:
    """One `metrics.jsonl` row with the keys the trainer writes (the same functions make them)."""
    rollouts = _rollouts(step, rng)
    return {
        "step": float(step),
        **staleness(rollouts, step - 1),
        "learner/loss": 0.5 * math.exp(-step / 300) + 0.02 * rng.random(),
        "learner/kl": 0.001 * step / (step + 50),
        "learner/max_logprob_diff": 1e-5 * (1 + rng.random()),
        "learner/grad_norm": 1.0 + rng.random(),
        **domain_metrics(rollouts),
        "policy_version": float(step),
        "time/generate_s": 1.2 + 0.3 * rng.random(),
        "time/score_s": 0.2 + 0.1 * rng.random(),
        "time/learn_s": 0.6 + 0.1 * rng.random(),
        "time/push_s": 0.05,
        "time/step_s": 2.1,
    }


def transcript_row(step: int, rollout: Rollout) -> dict[str, Any]:
    return {"step": step, "prompt": [{"role": "user", "content": PROMPTS[rollout.env]}], **rollout.to_dict()}


def write_run(
    root: Path, name: str, steps: int, total: int | None = None, finished: bool = True, seed: int = 0
) -> Path:
    """A run directory as the trainer leaves it after `steps` of `total` steps (`finished`: with its final
    checkpoint pointer and cost.json), with two transcripts per step."""
    rng = random.Random(seed)
    run_dir = root / name
    run_dir.mkdir(parents=True)
    config = parse_config(
        {
            "model": {"name": "tiny"},
            "envs": {"weights": {env: 1.0 for env in DOMAINS}},
            "run": {"name": name, "out_dir": str(root), "steps": total or steps},
        }
    )
    (run_dir / "config.toml").write_text(dump_config(config))
    with (run_dir / "metrics.jsonl").open("w") as metrics, (run_dir / "transcripts.jsonl").open("w") as kept:
        for step in range(1, steps + 1):
            metrics.write(json.dumps(metrics_row(step, rng)) + "\n")
            for rollout in _rollouts(step, rng, per_domain=1):
                kept.write(json.dumps(transcript_row(step, rollout)) + "\n")
    if finished:
        checkpoint = run_dir / "checkpoints" / f"step-{steps:06d}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "trainer.json").write_text(json.dumps({"step": steps, "cursors": {}}))
        (run_dir / "checkpoints" / LATEST).write_text(checkpoint.name)
        (run_dir / COST_FILE).write_text(json.dumps({"steps": steps, "cost/standard_usd_total": "0.0123"}))
    return run_dir


def write_evaluation(run_dir: Path) -> None:
    rows = [
        {
            "env": env,
            "prompts": 32,
            "samples_per_prompt": 4,
            "reward_before": 0.21,
            "reward_after": after,
            "delta": after - 0.21,
            "stderr": 0.02,
            "noise": 0.04,
            "pass_before": 0.15,
            "pass_after": after - 0.05,
            "clear": after - 0.21 > 0.04,
        }
        for env, after in (("math/arithmetic", 0.58), ("code/python", 0.24), ("all", 0.41))
    ]
    (run_dir / EVALUATION).write_text(json.dumps(rows))


def _age(run_dir: Path, seconds: float) -> None:
    """Make every file of the run look written `seconds` ago."""
    then = time.time() - seconds
    for path in [run_dir, *run_dir.rglob("*")]:
        os.utime(path, (then, then))


def _client(root: Path) -> TestClient:
    return TestClient(create_app(ConsoleConfig(runs=(root,))))


def test_status_is_read_from_what_the_trainer_wrote(tmp_path: Path) -> None:
    write_run(tmp_path, "done", 5)
    _age(write_run(tmp_path, "training", 3, total=10, finished=False), 5)
    _age(write_run(tmp_path, "crashed", 3, total=10, finished=False), 3600)
    stopped = write_run(tmp_path, "stopped", 4, total=10)  # a stop request checkpoints its last step
    _age(stopped, 3600)
    status = {run.name: run.status for run in list_runs((tmp_path,), time.time())}
    assert status == {
        "done": RunStatus.FINISHED,
        "training": RunStatus.RUNNING,
        "crashed": RunStatus.FAILED,
        "stopped": RunStatus.STOPPED,
    }


def test_the_list_shows_each_runs_step_reward_and_status(tmp_path: Path) -> None:
    write_run(tmp_path, "alpha", 7)
    (tmp_path / "not-a-run").mkdir()
    client = _client(tmp_path)
    runs = client.get("/api/runs").json()["runs"]
    assert [(r["name"], r["status"], r["step"], r["steps"]) for r in runs] == [("alpha", "finished", 7, 7)]
    last = json.loads((tmp_path / "alpha" / "metrics.jsonl").read_text().splitlines()[-1])
    assert runs[0]["reward"] == last["reward"]
    page = client.get("/runs").text
    assert 'href="/runs/alpha"' in page and "not-a-run" not in page


def test_series_are_every_step_after_since_and_thinned_when_asked(tmp_path: Path) -> None:
    write_run(tmp_path, "long", 30)
    client = _client(tmp_path)
    assert [p["x"] for p in client.get("/api/runs/long/series?since=27").json()["points"]] == [28, 29, 30]
    thinned = client.get("/api/runs/long/series?max_points=10").json()["points"]
    assert len(thinned) <= 10 and thinned[-1]["x"] == 30


def test_a_long_runs_charts_are_thinned_to_at_most_max_points(tmp_path: Path) -> None:
    write_run(tmp_path, "long", MAX_POINTS * 2 + 7)
    page = _client(tmp_path).get("/runs/long").text
    spec = json.loads(page.split("data-chart='")[1].split("'")[0].replace("&#39;", "'"))
    assert len(spec["data"][0]) <= MAX_POINTS and spec["data"][0][-1] == MAX_POINTS * 2 + 7


def test_transcripts_filter_by_domain_reward_and_qc_newest_first(tmp_path: Path) -> None:
    write_run(tmp_path, "r", 60)
    client = _client(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "r" / "transcripts.jsonl").read_text().splitlines()]

    def got(query: str) -> dict[str, Any]:
        answer = client.get(f"/api/runs/r/transcripts?{query}")
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    math_rows = got("domain=math/arithmetic")
    assert math_rows["matching"] == sum(r["env"] == "math/arithmetic" for r in rows)
    assert [t["step"] for t in math_rows["transcripts"]] == list(range(60, 50, -1))
    high = got("min_reward=0.7&max_reward=1")
    assert high["matching"] == sum(0.7 <= r["reward"] <= 1 for r in rows)
    assert all(t["reward"] >= 0.7 for t in high["transcripts"])
    violations = got("qc=violations")
    assert violations["matching"] == sum(r["qc_violation"] is not None for r in rows)
    assert got("qc=clean")["matching"] == len(rows) - violations["matching"]
    second = got("page=2")
    assert second["page"] == 2 and second["transcripts"][0]["step"] == 55
    fragment = client.get("/runs/r/transcripts?domain=code/python&min_reward=&qc=any").text
    assert "code/python" in fragment and "math/arithmetic" not in fragment


def test_the_run_page_shows_evaluation_config_and_no_live_stream_once_finished(tmp_path: Path) -> None:
    write_evaluation(write_run(tmp_path, "demo", 12))
    page = _client(tmp_path).get("/runs/demo").text
    assert 'id="evaluation"' in page and "clear gain" in page
    assert "[run]" in page and "data-live" not in page


def test_the_event_stream_of_a_finished_run_sends_the_rest_then_ends(tmp_path: Path) -> None:
    write_run(tmp_path, "done", 4)
    body = _client(tmp_path).get("/api/runs/done/events?since=2").text
    assert body.index("event: points") < body.index("event: end")
    sent = json.loads(body.split("event: points")[1].split("data: ")[1].split("\r\n")[0])
    assert [point["x"] for point in sent] == [3, 4]


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/api/runs/nope", 404, "unknown_run"),
        ("/api/runs/nope/series", 404, "unknown_run"),
        ("/api/runs/nope/events", 404, "unknown_run"),
        ("/api/runs/a..b", 400, "invalid_input"),
        ("/api/runs/..", 404, "unknown_page"),
        ("/api/runs/%2e%2e%2fetc", 404, "unknown_page"),
        ("/api/runs/ok/transcripts?domain=nope/none", 400, "invalid_input"),
        ("/api/runs/ok/transcripts?min_reward=abc", 400, "invalid_input"),
        ("/api/runs/ok/transcripts?max_reward=nan", 400, "invalid_input"),
        ("/api/runs/ok/transcripts?min_reward=2&max_reward=1", 400, "invalid_input"),
        ("/api/runs/ok/transcripts?qc=maybe", 400, "invalid_input"),
        ("/api/runs/ok/transcripts?page=0", 400, "invalid_input"),
        ("/api/runs/ok/transcripts?page=-3", 400, "invalid_input"),
        ("/api/runs/ok/series?since=-1", 400, "invalid_input"),
        ("/api/runs/ok/series?max_points=x", 400, "invalid_input"),
    ],
)
def test_bad_input_answers_4xx_json(tmp_path: Path, path: str, status: int, code: str) -> None:
    write_run(tmp_path, "ok", 3)
    answer = _client(tmp_path).get(path)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == code


@pytest.mark.parametrize("path", ["/runs/nope", "/runs/a..b", "/runs/ok?min_reward=abc", "/runs/ok?qc=x"])
def test_bad_input_on_a_page_is_a_page_that_says_so(tmp_path: Path, path: str) -> None:
    write_run(tmp_path, "ok", 3)
    answer = _client(tmp_path).get(path)
    assert 400 <= answer.status_code < 500
    assert "error-page" in answer.text and "Traceback" not in answer.text


def test_a_run_without_a_step_yet_is_running_and_its_page_says_so(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path, "starting", 0, total=10, finished=False)
    client = _client(tmp_path)
    assert client.get("/api/runs/starting").json()["status"] == "running"
    page = client.get("/runs/starting").text
    assert "No steps recorded yet" in page
    assert 'data-live="/api/runs/starting/events?since=0"' in page
    _age(run_dir, 3600)
    assert client.get("/api/runs/starting").json()["status"] == "failed"


def test_a_half_written_or_broken_line_is_skipped_not_a_failure(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path, "torn", 5)
    with (run_dir / "metrics.jsonl").open("a") as handle:
        handle.write("not json\n" + '{"step": 6, "rew')
    with (run_dir / "transcripts.jsonl").open("a") as handle:
        handle.write('{"step": 6, "env": "math/ari')
    client = _client(tmp_path)
    assert client.get("/api/runs/torn").json()["step"] == 5
    assert [p["x"] for p in client.get("/api/runs/torn/series?since=3").json()["points"]] == [4, 5]
    assert client.get("/api/runs/torn/transcripts").json()["matching"] == 10
    assert client.get("/runs/torn").status_code == 200


def test_charts_draw_the_trainers_metrics_per_domain_and_only_the_lines_a_run_has() -> None:
    rng = random.Random(0)
    rows = [metrics_row(step, rng) for step in (1, 2)]
    plans = {plan.title: plan for plan in chart_plans(rows)}
    assert plans["math/arithmetic: reward and components"].keys == [
        "domain/math/arithmetic/reward",
        "domain/math/arithmetic/reward/correct",
        "domain/math/arithmetic/reward/format",
    ]
    assert plans["code/python: truncation rate"].keys == ["domain/code/python/truncation_rate"]
    assert plans["Seconds per step"].labels == ["generate", "score", "learn", "push"]  # a sync run waits not
    waited = [{**row, "time/wait_s": 0.5} for row in rows]  # an async run's rows
    assert next(p for p in chart_plans(waited) if p.title == "Seconds per step").labels[-1] == "wait"
