"""`--device`, `--dtype`, `--rope-scaling` and `--max-model-len` of every command that runs tether's own
engine: one spelling, and a bad value fails with the accepted ones before any model is pulled or loaded
(the model here is an empty folder, whose loading error would come first otherwise); good ones reach
the engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tether.cli.main import app
from tether.errors import ConfigError
from tether.models.config import RopeScaling
from tether.web import free_port

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


def test_serve_refuses_a_kv_cache_dtype_it_does_not_know_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TETHER_HOME", str(tmp_path / "home"))
    empty = tmp_path / "model"
    empty.mkdir()
    result = runner.invoke(app, [*COMMANDS["serve"], "--model", str(empty), "--kv-cache-dtype", "int8"])
    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert "error: --kv-cache-dtype = 'int8': expected one of float32, bfloat16, float16" in output


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize(
    ("option", "expected"),
    [
        (["--rope-scaling", "wavy:2"], "error: rope scaling type 'wavy' is not supported; accepted: default"),
        (["--rope-scaling", "yarn"], "error: rope scaling 'yarn': expected TYPE:FACTOR"),
        (["--max-model-len", "0"], "Invalid value for '--max-model-len': Input should be greater than or"),
    ],
    ids=["rope-type", "rope-form", "max-model-len"],
)
def test_a_bad_rope_scaling_or_max_model_len_fails_before_the_model_loads(
    command: str, option: list[str], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TETHER_HOME", str(tmp_path / "home"))
    empty = tmp_path / "model"
    empty.mkdir()
    result = runner.invoke(app, [*COMMANDS[command], "--model", str(empty), *option])
    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert expected in output


REACHING = {
    "serve": ["serve", "--port", str(free_port())],
    "eval": ["eval", "--envs", "math/arithmetic", "-n", "1", "--kv-cache-mib", "64"],
    "agent run": ["agent", "run", "say hello", "--kv-cache-mib", "64"],
    "worker": ["worker", "--exit-when-idle", "--kv-cache-mib", "64"],
}


@pytest.mark.parametrize("command", list(REACHING))
def test_max_model_len_and_rope_scaling_reach_the_engine(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the command hands `LLMEngine.from_pretrained`, which checks them against the model."""
    from tether.engine.llm_engine import LLMEngine

    given: dict[str, object] = {}

    def from_pretrained(path: object, **options: object) -> None:
        given.update(options)
        raise ConfigError("stopped before loading")

    monkeypatch.setattr(LLMEngine, "from_pretrained", from_pretrained)
    monkeypatch.setenv("TETHER_HOME", str(tmp_path / "home"))
    empty = tmp_path / "model"
    empty.mkdir()
    options = ["--device", "cpu", "--max-model-len", "32768", "--rope-scaling", "yarn:4"]
    result = runner.invoke(app, [*REACHING[command], "--model", str(empty), *options])
    assert "error: stopped before loading" in " ".join(result.output.split())
    assert given["max_model_len"] == 32768
    assert given["rope_scaling"] == RopeScaling(rope_type="yarn", factor=4.0)
    assert given["kv_cache_mib"] == 64 or command == "serve"


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
