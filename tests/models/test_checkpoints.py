"""A trained run's checkpoint loads as a model: the trained weights (LoRA merged), exported once, and
every path that names no usable checkpoint refused with what exists."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from typer.testing import CliRunner

from tests.live_server import free_port, served_process
from tests.rl.fake_envs import fake_registry
from tether.chat import ChatRequest
from tether.cli.main import app
from tether.engine.llm_engine import LLMEngine
from tether.engine.model_runner import SequenceChunk
from tether.errors import ConfigError
from tether.models.checkpoints import EXPORT, MANIFEST, find_checkpoint
from tether.models.dense import DenseBatch, hidden_states
from tether.models.loader import resolve
from tether.models.transformer import CausalLM
from tether.rl.builders import build_trainer
from tether.rl.config import parse_config
from tether.serving.engine_client import EngineClient

PROMPT = [5, 17, 42, 9, 100, 3, 77, 8]
LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@dataclass(frozen=True, slots=True)
class TrainedRun:
    run_dir: Path
    base: Path
    learner_logits: torch.Tensor  # [len(PROMPT), vocab]: the learner's model after its last step


def dense_logits(model: CausalLM) -> torch.Tensor:
    """Every position's logits from the learner's own (training) forward."""
    with torch.no_grad():
        logits: torch.Tensor = model.lm_head(hidden_states(model, DenseBatch.padded([PROMPT]))[0]).float()
    return logits


def engine_logits(engine: LLMEngine) -> torch.Tensor:
    """Every position's logits from the engine's paged forward over `PROMPT`."""
    logits: torch.Tensor = engine.runner.step([SequenceChunk(PROMPT, 0, [0], all_logits=True)])
    return logits


def train(base: Path, out_dir: Path, name: str, lora: bool) -> TrainedRun:
    """Two steps through `build_trainer`, the entry `tether train` runs, on rewards a tiny model moves."""
    model: dict[str, object] = {"name": str(base), "kv_cache_mib": 8, "device": "cpu"}
    if lora:
        model["lora"] = LORA
    config = parse_config(
        {
            "model": model,
            "envs": {"weights": {"test/vowels": 1.0, "test/digits": 1.0}},
            "rollout": {"prompts_per_step": 3, "samples_per_prompt": 4, "max_new_tokens": 8},
            "optim": {"lr": 3e-2 if lora else 1e-2},
            "run": {"name": name, "out_dir": str(out_dir), "steps": 2, "checkpoint_every": 1, "seed": 7},
        },
        "test",
    )
    trainer = build_trainer(config, registry=fake_registry())
    try:
        trainer.run()
        logits = dense_logits(trainer.learner.model)
    finally:
        trainer.close()
    return TrainedRun(out_dir / name, base, logits)


@pytest.fixture(scope="module")
def runs(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, TrainedRun]:
    out_dir = tmp_path_factory.mktemp("runs")
    base = tiny_model("llama")
    return {name: train(base, out_dir, name, name == "lora") for name in ("full", "lora")}


def base_logits(base: Path) -> torch.Tensor:
    engine, _ = LLMEngine.from_pretrained(base, kv_cache_mib=8)
    return engine_logits(engine)


@pytest.mark.parametrize("kind", ["full", "lora"])
@pytest.mark.parametrize("spec", ["{run}", "{run}/checkpoints/latest", "{run}/checkpoints/step-000002"])
def test_engine_loads_the_trained_weights_of_a_run(runs: dict[str, TrainedRun], kind: str, spec: str) -> None:
    run = runs[kind]
    engine, _ = LLMEngine.from_pretrained(spec.format(run=run.run_dir), kv_cache_mib=8)
    served = engine_logits(engine)
    assert torch.allclose(served, run.learner_logits, atol=1e-4, rtol=0)
    # The trained weights, not the base's: training moved the logits far beyond the tolerance.
    assert (served - base_logits(run.base)).abs().max() > 1e-2


def test_an_export_is_written_once_and_whole(runs: dict[str, TrainedRun]) -> None:
    checkpoint = runs["full"].run_dir / "checkpoints" / "step-000001"
    folder = resolve(checkpoint)
    assert folder == checkpoint / EXPORT and (folder / MANIFEST).is_file()
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= {p.name for p in folder.iterdir()}
    written = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve(checkpoint) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == written
    assert [p.name for p in checkpoint.iterdir() if p.name.startswith(f".{EXPORT}")] == []


def test_a_plain_folder_and_a_registered_name_are_no_runs(tiny_model: Callable[[str], Path]) -> None:
    assert find_checkpoint(tiny_model("llama")) is None
    assert find_checkpoint(Path("smollm2-135m-instruct")) is None
    assert resolve(tiny_model("llama")) == tiny_model("llama")


def _run_without_checkpoints(root: Path) -> Path:
    run = root / "fresh"
    run.mkdir()
    (run / "config.toml").write_text('[model]\nname = "smollm2-135m-instruct"\n')
    return run


def _checkpoints_without_pointer(root: Path) -> Path:
    run = _run_without_checkpoints(root)
    (run / "checkpoints" / "step-000001.tmp").mkdir(parents=True)
    return run / "checkpoints" / "latest"


def _copied_run(root: Path, runs: dict[str, TrainedRun]) -> Path:
    run = root / "copy"
    # Without the exports earlier tests made: each case is about what a fresh load meets.
    shutil.copytree(runs["full"].run_dir, run, ignore=shutil.ignore_patterns(EXPORT))
    return run


def _pointer_to_a_rotated_step(root: Path, runs: dict[str, TrainedRun]) -> Path:
    run = _copied_run(root, runs)
    (run / "checkpoints" / "latest").write_text("step-000009\n")
    return run


def _tmp_step(root: Path, runs: dict[str, TrainedRun]) -> Path:
    run = _copied_run(root, runs)
    (run / "checkpoints" / "step-000002").rename(run / "checkpoints" / "step-000003.tmp")
    return run / "checkpoints" / "step-000003.tmp"


def _step_without_state(root: Path, runs: dict[str, TrainedRun]) -> Path:
    run = _copied_run(root, runs)
    shutil.rmtree(run / "checkpoints" / "step-000002" / "state")
    return run / "checkpoints" / "step-000002"


def _checkpoint_without_run_config(root: Path, runs: dict[str, TrainedRun]) -> Path:
    run = _copied_run(root, runs)
    (run / "config.toml").unlink()
    return run / "checkpoints" / "latest"


BAD_PATHS: list[tuple[Callable[[Path, dict[str, TrainedRun]], Path], str]] = [
    (lambda root, _: _run_without_checkpoints(root), r"has no checkpoints/ folder.*holds: config\.toml"),
    (lambda root, _: _checkpoints_without_pointer(root), r"latest' is missing \(no checkpoint has finished"),
    (lambda root, _: root / "nope" / "checkpoints" / "latest", r"run directory '.*nope' does not exist"),
    (
        lambda root, _: root / "nope",
        r"unknown model '.*nope': no such folder; expected a model folder, a run",
    ),
    (_pointer_to_a_rotated_step, r"step-000009' does not exist; .* holds: latest, step-000001, step-000002"),
    (_tmp_step, r"step-000003\.tmp' is an unfinished checkpoint .*finished checkpoints: step-000001$"),
    (_step_without_state, r"step-000002' has no state/ folder of model weights \(it holds: extra\.pt"),
    (_checkpoint_without_run_config, r"config\.toml' is missing: it names the base model the run trained"),
]


@pytest.mark.parametrize(("make", "message"), BAD_PATHS)
def test_a_path_naming_no_usable_checkpoint_is_refused(
    runs: dict[str, TrainedRun],
    tmp_path: Path,
    make: Callable[[Path, dict[str, TrainedRun]], Path],
    message: str,
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(make(tmp_path, runs))


def test_serve_refuses_a_run_without_checkpoints_naming_it(tmp_path: Path) -> None:
    run = _run_without_checkpoints(tmp_path)
    result = CliRunner().invoke(app, ["serve", "--model", str(run), "--port", str(free_port())])
    assert result.exit_code != 0
    assert "has no checkpoints/ folder" in " ".join(result.output.split())  # rich wraps long lines


def test_agent_engine_client_answers_from_a_run_checkpoint(
    runs: dict[str, TrainedRun], tmp_path: Path
) -> None:
    """`tether agent run/resume` and `tether worker` reach the in-process engine through `EngineClient`."""
    name = str(runs["lora"].run_dir / "checkpoints" / "latest")

    async def ask() -> dict[str, object]:
        model = EngineClient(name, tmp_path, kv_cache_mib=8, device="cpu")
        try:
            request = ChatRequest([{"role": "user", "content": "hi"}], max_tokens=4)
            return (await model.complete(request)).message
        finally:
            await model.close()

    assert asyncio.run(ask())["role"] == "assistant"


@pytest.fixture
def served_run(runs: dict[str, TrainedRun]) -> Iterator[tuple[str, str]]:
    """`tether serve --model RUN/checkpoints/latest` in its own process: (base url, the served name)."""
    model = str(runs["full"].run_dir / "checkpoints" / "latest")
    with served_process(model, "--kv-cache-mib", "8", "--device", "cpu") as url:
        yield url, model


def test_serve_answers_a_chat_completion_from_a_run_checkpoint(served_run: tuple[str, str]) -> None:
    url, model = served_run
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == model
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["role"] == "assistant"
