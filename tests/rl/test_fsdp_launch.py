"""`torchrun --nproc-per-node 2 -m tether train`: rank 0 trains and writes the run, rank 1 follows it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tether.cli.main import app
from tether.rl.checkpoint import latest_checkpoint, saved_model

from .test_cli_train import _write_config


def test_torchrun_launches_a_two_rank_run_that_rank_zero_records(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    config = _write_config(tmp_path / "train.toml", tiny_model("llama"), tmp_path / "runs")
    with open(config, "a") as handle:
        handle.write('\n[learner]\nstrategy = "fsdp"\nworld_size = 2\n')
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = subprocess.run(
        [*command, "-m", "tether", "train", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "step 2/2" in result.stdout
    run_dir = tmp_path / "runs" / "cli"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert all(line["learner/tokens"] > 0 for line in lines)
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint.step == 2
    # Both ranks wrote their shards of the model and optimizer; the checkpoint reads back whole.
    assert len(list((checkpoint.path / "state").glob("*.distcp"))) == 2
    assert "model.embed_tokens.weight" in saved_model(checkpoint.path)


@pytest.mark.parametrize(
    ("world_size", "message"),
    [("0", "--world-size: learner.world_size = 0"), ("2", "world_size = 2 with learner.strategy = 'single'")],
)
def test_world_size_option_is_checked(
    tiny_model: Callable[[str], Path], tmp_path: Path, world_size: str, message: str
) -> None:
    config = _write_config(tmp_path / "train.toml", tiny_model("llama"), tmp_path / "runs")
    result = CliRunner().invoke(app, ["train", "--config", str(config), "--world-size", world_size])
    assert result.exit_code != 0
    assert message in " ".join(result.output.split())
    assert not (tmp_path / "runs").exists()
