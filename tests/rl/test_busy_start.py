"""The busy-start benchmark: a run started beside a CPU hog, timed against the same run idle."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tether.envs.registry import EnvRegistry
from tether.models.threads import available_cores
from tether.rl.busy_start import BusyStartConfig, PhaseResult, ThreadSample, run_busy_start

from .fake_envs import reward_env
from .test_trainer import tiny_config

ROOT = Path(__file__).parents[2]
SMOLLM2 = "smollm2-135m-instruct"


def sample(t_s: float, decisions: int) -> ThreadSample:
    return ThreadSample(t_s=t_s, step=1, threads=1, changes=0, decisions=decisions)


@pytest.mark.parametrize(
    ("decisions_before", "decisions_after", "redecided"),
    [
        (3, 5, True),  # a whole window weighed after the hog went
        (3, 4, False),  # only the window the hog stopped in
        (3, 3, False),
    ],
)
def test_redecided_means_a_window_after_the_hog_stopped(
    decisions_before: int, decisions_after: int, redecided: bool
) -> None:
    phase = PhaseResult(
        hog_stopped_s=2.0, threads=[sample(1.0, decisions_before), sample(3.0, decisions_after)]
    )
    assert phase.redecided_after_hog() is redecided
    assert PhaseResult(hog_stopped_s=None, threads=phase.threads).redecided_after_hog() is False


def test_the_hog_must_last(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hog_s must be > 0, got 0"):
        BusyStartConfig(tiny_config(tmp_path / "model", tmp_path), hog_s=0)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the hog takes one of two cores")
def test_smoke_busy_start_reports_the_ratio_and_redecides_once_the_hog_stops(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """Tiny model, 2 s of hog, windows of 0.25 s: a few seconds in all. Scoring waits 60 ms a sample
    (no CPU; 2.4 s in 40 steps even if a step scores its samples at once), so each phase outlasts the hog
    however fast the machine is."""

    async def slow_reward(_: object) -> float:
        await asyncio.sleep(0.06)
        return 1.0

    registry = EnvRegistry()
    registry.add(reward_env("test/slow", slow_reward))
    train = tiny_config(
        tiny_model("qwen3"),
        tmp_path,
        run={"steps": 40, "checkpoint_every": 1000, "threads_window_s": 0.25},
        rollout={"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 8},
        envs={"weights": {"test/slow": 1.0}},
    )
    report = run_busy_start(BusyStartConfig(train, hog_s=2.0), registry=registry)
    json.dumps(report)  # the report is plain JSON
    assert math.isfinite(report["busy_start_speed_ratio"]) and report["busy_start_speed_ratio"] > 0
    idle, busy = report["phases"]["idle"], report["phases"]["busy_start"]
    assert idle["hog_stopped_s"] is None
    assert busy["hog_stopped_s"] == pytest.approx(2.0, abs=1.0), busy
    assert busy["wall_s"] > busy["hog_stopped_s"], "the run outlasted the hog"
    assert report["redecided_after_hog"], busy["threads"]
    for phase in (idle, busy):
        assert [s["step"] for s in phase["threads"]] == list(range(1, 41))
        assert all(1 <= s["threads"] <= available_cores() for s in phase["threads"])
    assert report["machine"]["cpu"] and "load_average_start" in report["machine"]


def test_the_script_refuses_a_bad_step_count() -> None:
    script = ROOT / "scripts" / "busy-start.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), "--steps", "0"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 2 and "--steps must be at least 1, got 0" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_busy_start_on_the_shipped_demo(tmp_path: Path) -> None:
    """The real benchmark: the shipped demo config's 16 steps (SmolLM2, 8 prompts x 4 samples, 64 new
    tokens) with the hog's full minute; the figure is whatever the machine gives (see README)."""
    from tether.config import load_settings
    from tether.models.cache import list_cached

    if SMOLLM2 not in {model.name for model in list_cached(load_settings(None).cache_dir)}:
        pytest.skip(f"{SMOLLM2} is not in the cache: tether models pull {SMOLLM2}")
    out = tmp_path / "busy-start.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "scripts" / "busy-start.py"), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["busy_start_speed_ratio"] > 0 and report["steps"] == 16
    assert report["phases"]["busy_start"]["hog_stopped_s"] is not None
