"""Checkpoints through torch.distributed.checkpoint: written in the background, never visible half-way."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from tether.models import load
from tether.rl.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    saved_model,
    start_checkpoint,
)
from tether.rl.learner import Learner
from tether.rl.trainer import learner_options

from .test_resume import _stable
from .test_trainer import make_trainer, tiny_config


class _StuckWrite:
    """A learner whose background write never finishes: the process dies before it does."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner

    def save_state(self, directory: Path) -> Future[Any]:
        self.learner.save_state(directory)  # some files are there, but the write is not complete
        return Future()

    def load_state(self, directory: Path) -> None:
        self.learner.load_state(directory)


def test_a_checkpoint_still_being_written_never_becomes_the_latest(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    config = tiny_config(tiny_model("llama"), tmp_path)
    learner = Learner(load(config.model.name)[0], **learner_options(config))
    save_checkpoint(config.run_dir, 1, learner, {"cursors": {}})
    saved = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    with torch.no_grad():
        for param in learner.model.parameters():
            param.add_(1.0)
    start_checkpoint(config.run_dir, 2, _StuckWrite(learner), {"cursors": {}})  # ...then the kill
    assert (config.run_dir / "checkpoints" / "step-000002.tmp").is_dir()
    latest = latest_checkpoint(config.run_dir)
    assert latest.step == 1
    fresh = Learner(load(config.model.name)[0], **learner_options(config))
    load_checkpoint(latest, fresh)
    for name, param in fresh.model.named_parameters():
        assert torch.equal(param, saved[name]), name
    # The next save (a resumed run's) drops what the killed one left.
    save_checkpoint(config.run_dir, 2, fresh, {"cursors": {}})
    assert sorted(p.name for p in (config.run_dir / "checkpoints").iterdir()) == [
        "latest",
        "step-000001",
        "step-000002",
    ]


def test_background_checkpoints_resume_like_an_uninterrupted_run(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    model = tiny_model("llama")
    background: dict[str, Mapping[str, object]] = {"learner": {"async_checkpoint": True}}
    straight = make_trainer(tiny_config(model, tmp_path / "a"))
    expected = straight.run()
    straight.close()
    first = make_trainer(
        tiny_config(model, tmp_path / "b", run={"steps": 2, "checkpoint_every": 1}, **background)
    )
    first.run()
    first.close()
    run_dir = tmp_path / "b" / "tiny"
    assert latest_checkpoint(run_dir).step == 2
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    resumed = make_trainer(tiny_config(model, tmp_path / "b", **background), resume=True)
    rest = resumed.run()
    resumed.close()
    assert _stable(rest[0]) == pytest.approx(_stable(expected[2]), abs=1e-6)
    final = saved_model(latest_checkpoint(run_dir).path)
    for name, param in straight.learner.model.named_parameters():
        assert torch.allclose(final[name], param.detach(), atol=1e-6), name
