"""`--device` and `--dtype` of every command that runs tether's own engine: one spelling, and a bad value
fails with the accepted ones before any model is pulled or loaded (the model here is an empty folder,
whose loading error would come first otherwise)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tether.cli.main import app

runner = CliRunner()

COMMANDS = {
    "serve": ["serve", "--port", "1"],  # never bound: the options are checked first
    "eval": ["eval", "--envs", "no-such-env"],
    "agent run": ["agent", "run", "say hello"],
    "worker": ["worker", "--exit-when-idle"],
}
BAD = [
    (["--device", "gpu"], "--device = 'gpu': expected auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:99"], "--device = 'cuda:99': this machine has"),
    (["--dtype", "fp8"], "--dtype = 'fp8': expected one of float32, bfloat16, float16"),
]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize(("option", "expected"), BAD, ids=["device", "missing-cuda", "dtype"])
def test_a_bad_device_or_dtype_fails_before_the_model_loads(
    command: str, option: list[str], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TETHER_HOME", str(tmp_path / "home"))
    empty = tmp_path / "model"
    empty.mkdir()
    result = runner.invoke(app, [*COMMANDS[command], "--model", str(empty), *option])
    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert f"error: {expected}" in output


def test_serve_passes_the_block_wise_attention_settings_to_the_engine(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import tether.serving.launcher as launcher

    seen: dict[str, Any] = {}
    monkeypatch.setattr(launcher, "listen", lambda host, port: None)
    monkeypatch.setattr(launcher, "serve", lambda folder, **options: seen.update(options))
    arguments = ["serve", "--model", str(tiny_model("llama"))]
    result = runner.invoke(
        app, [*arguments, "--attention-block-tokens", "256", "--blockwise-min-context", "8192"]
    )
    assert result.exit_code == 0, result.output
    assert (seen["attention_block_tokens"], seen["blockwise_min_context"]) == (256, 8192)
    result = runner.invoke(app, [*arguments, "--attention-block-tokens", "-1"])
    assert result.exit_code == 2 and "--attention-block-tokens" in result.output
