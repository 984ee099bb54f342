"""Kill a run mid-way with SIGTERM, resume it, and get the same next steps as an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch

from tether.errors import ConfigError

from .test_trainer import make_trainer, tiny_config

# Wall-clock figures differ between any two runs; so do the prefix cache's hits (an engine's cache is not
# checkpointed, and each Ray worker has its own), and with them the split of prompt tokens and the cost.
VOLATILE = ("time/", "tokens_per_s", "sandbox/cpu_s", "tokens/prompt_", "cost/", "run/threads")


def _stable(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}


def test_resumed_run_matches_an_uninterrupted_run(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    model = tiny_model("llama")
    overrides: dict[str, Mapping[str, object]] = {
        "run": {"steps": 3, "checkpoint_every": 3},
        "algorithm": {"aggregation": "token_mean"},
    }
    straight = make_trainer(tiny_config(model, tmp_path / "a", **overrides))
    expected = straight.run()
    straight.close()

    killed = make_trainer(tiny_config(model, tmp_path / "b", **overrides))

    def kill_after_two(metrics: dict[str, float]) -> None:
        if metrics["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the real signal: the handler checkpoints and returns

    first = killed.run(on_step=kill_after_two)
    killed.close()
    assert [m["step"] for m in first] == [1, 2]
    assert (tmp_path / "b" / "tiny" / "checkpoints" / "step-000002").is_dir()
    # A stray line from a step that ran after the checkpoint is dropped on resume.
    with open(tmp_path / "b" / "tiny" / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps({"step": 3, "reward": 99.0}) + "\n")

    resumed = make_trainer(tiny_config(model, tmp_path / "b", **overrides), resume=True)
    assert resumed.step == 2
    rest = resumed.run()
    resumed.close()
    assert [m["step"] for m in rest] == [3]
    for got, want in zip(rest, expected[2:], strict=True):
        assert _stable(got) == pytest.approx(_stable(want), abs=1e-6)
        prompt = ("tokens/prompt_cached", "tokens/prompt_uncached")
        assert sum(got[key] for key in prompt) == sum(want[key] for key in prompt)  # cached or not
    for (name, a), (_, b) in zip(
        straight.learner.model.named_parameters(), resumed.learner.model.named_parameters(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-6), name
    lines = (tmp_path / "b" / "tiny" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def test_resume_without_checkpoint_is_refused(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no checkpoint to resume from"):
        make_trainer(tiny_config(tiny_model("llama"), tmp_path), resume=True)


def test_starting_over_an_existing_run_is_refused(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    config = tiny_config(tiny_model("llama"), tmp_path)
    (config.run_dir / "checkpoints").mkdir(parents=True)
    (config.run_dir / "checkpoints" / "latest").write_text("step-2\n")
    with pytest.raises(ConfigError, match="already holds a run: resume it with --resume"):
        make_trainer(config)


def test_a_run_killed_before_its_first_checkpoint_committed_starts_over_without_its_lines(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    config = tiny_config(tiny_model("llama"), tmp_path, run={"steps": 2})
    partial = config.run_dir / "checkpoints" / "step-000001.tmp"
    partial.mkdir(parents=True)  # what a SIGKILL during the first save leaves: no `latest`
    (config.run_dir / "metrics.jsonl").write_text('{"step": 1, "killed_attempt": true}\n')
    trainer = make_trainer(config)
    try:
        history = trainer.run()
    finally:
        trainer.close()
    lines = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert "killed_attempt" not in lines[0] and lines[0]["reward"] == history[0]["reward"]
    assert not partial.exists() and (config.run_dir / "checkpoints" / "latest").is_file()
