"""Checkpoints through torch.distributed.checkpoint: written in the background, never visible half-way."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from tether.errors import ConfigError
from tether.models import load
from tether.rl.builders import learner_options
from tether.rl.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    saved_model,
    start_checkpoint,
)
from tether.rl.learner import Learner
from tether.rl.losses import LossConfig
from tether.rl.sections import OptimSection

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


_SAVE_FOREVER = """
import sys
from pathlib import Path
from tether.errors import ConfigError
from tether.models import load
from tether.rl.checkpoint import save_checkpoint
from tether.rl.sections import OptimSection
from tether.rl.sections import OptimSection
from tether.rl.learner import Learner
from tether.rl.losses import LossConfig
from tether.rl.losses import LossConfig

learner = Learner(load(sys.argv[1])[0], OptimSection(), LossConfig(), 10, 1.0, 8, async_checkpoint=True)
for step in range(1, 100_000):
    save_checkpoint(Path(sys.argv[2]), step, learner, {"cursors": {}}, keep=2)
"""


def test_a_process_killed_while_saving_leaves_a_loadable_latest_checkpoint(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    model = tiny_model("llama")
    saver = subprocess.Popen([sys.executable, "-c", _SAVE_FOREVER, str(model), str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while latest_checkpoint_step(tmp_path) < 3:  # a few saves in: the kill lands mid-write or mid-rename
            assert saver.poll() is None and time.monotonic() < deadline, "the saving process did not start"
            time.sleep(0.05)
    finally:
        saver.send_signal(signal.SIGKILL)
        saver.wait()
    latest = latest_checkpoint(tmp_path)
    learner = Learner(load(model)[0], OptimSection(), LossConfig(), 10, 1.0, 8)
    load_checkpoint(latest, learner)  # whole: every file of the checkpoint it names is there
    assert set(saved_model(latest.path)) == set(learner.model.state_dict())


def latest_checkpoint_step(run_dir: Path) -> int:
    try:
        return latest_checkpoint(run_dir).step
    except (ConfigError, FileNotFoundError):
        return 0


def test_a_checkpoint_from_before_distributed_checkpoints_is_refused_by_name(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    old = tmp_path / "checkpoints" / "step-000004"
    old.mkdir(parents=True)
    (old / "trainer.json").write_text('{"step": 4, "cursors": {}}')
    torch.save({}, old / "model.pt")
    (tmp_path / "checkpoints" / "latest").write_text("step-000004\n")
    learner = Learner(load(tiny_model("llama"))[0], OptimSection(), LossConfig(), 10, 1.0, 8)
    with pytest.raises(
        ConfigError, match=r"has no state/ folder: it was written by an older tether \(model.pt\)"
    ):
        load_checkpoint(latest_checkpoint(tmp_path), learner)
