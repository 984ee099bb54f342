"""LoRA on a tiny model: only adapters train, the engine receives merged weights and then generates with
exactly the learner's policy, checkpoints hold the adapters alone and a resumed run repeats a straight one."""

from __future__ import annotations

import os
import signal
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from tether.engine.sampling import SamplingParams
from tether.envs.context import ScoringContext
from tether.errors import ConfigError
from tether.models import load
from tether.models.dense import DenseBatch, token_logprobs
from tether.rl.builders import make_engine, make_learner
from tether.rl.checkpoint import saved_model
from tether.rl.config import TrainConfig, dump_config, parse_config
from tether.rl.learner import Learner
from tether.rl.losses import LossConfig
from tether.rl.samples import Sample
from tether.rl.sections import LoraSection, OptimSection
from tether.rl.trainer import Trainer

from .fake_envs import fake_registry
from .test_trainer import tiny_config

LORA: dict[str, Any] = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
SAMPLES = [
    Sample([3, 4, 5, 6, 7], 2, [-4.0, -5.0, -4.5], 1.0),
    Sample([3, 4, 9, 8], 2, [-5.2, -5.1], -1.0),
]


def _lora_learner(folder: Path) -> Learner:
    model, _, _ = load(folder)
    return Learner(
        model,
        OptimSection(lr=1e-2),
        LossConfig(),
        total_steps=4,
        temperature=1.0,
        max_new_tokens=4,
        lora=LoraSection(**LORA),
    )


def test_only_the_adapters_train(tiny_model: Callable[[str], Path]) -> None:
    learner = _lora_learner(tiny_model("llama"))
    base = {n: p.detach().clone() for n, p in learner.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in learner.trainable.named_parameters()}
    assert adapters and all(".lora_" not in n for n in base)
    learner.step(SAMPLES)
    for name, param in learner.model.named_parameters():
        if name in base:
            assert torch.equal(param, base[name]), name
    moved = [n for n, p in learner.trainable.named_parameters() if not torch.equal(p, adapters[n])]
    assert any(n.startswith("lora_b.") for n in moved)
    assert len(learner.optimizer.param_groups[0]["params"]) == len(adapters)


def test_the_engine_gets_merged_weights_and_then_matches_the_learner(
    tiny_model: Callable[[str], Path],
) -> None:
    folder = tiny_model("llama")
    config = tiny_config(folder, Path("unused"))
    engine, _ = make_engine(config, "cpu")
    learner = _lora_learner(folder)
    pushed = dict(learner.weights())
    # B starts at 0: before any update the merged weights are the base weights.
    engine_params = dict(engine.named_parameters())
    assert set(pushed) == {
        f"model.layers.{i}.{m}.weight"
        for i in range(len(learner.model.model.layers))
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    }
    for name, tensor in pushed.items():
        assert torch.equal(tensor, engine_params[name]), name
    learner.step(SAMPLES)
    learner.step(SAMPLES)
    engine.update_weights(learner.weights())
    prompt = [3, 4, 5]
    (output,) = engine.generate([prompt], SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3))
    sequences = [prompt + c.token_ids for c in output.completions]
    with torch.no_grad():
        mine = token_logprobs(
            learner.model, DenseBatch.padded(sequences), [(len(prompt), len(s)) for s in sequences]
        )
    for ours, completion in zip(mine, output.completions, strict=True):
        assert torch.allclose(ours, torch.tensor(completion.logprobs), atol=1e-5, rtol=0)


def _lora_config(folder: Path, out_dir: Path, **sections: Mapping[str, object]) -> TrainConfig:
    config = tiny_config(folder, out_dir, **sections)
    model = config.model.model_copy(update={"lora": LoraSection(**LORA)})
    return config.model_copy(update={"model": model})


def _trainer(config: TrainConfig, resume: bool = False) -> Trainer:
    torch.manual_seed(config.run.seed)
    engine, tokenizer = make_engine(config, "cpu")
    trainer = Trainer(
        config, engine, tokenizer, make_learner(config, "cpu"), fake_registry(), ScoringContext()
    )
    trainer.start_run_dir(resume)
    return trainer


def test_checkpoints_hold_the_adapters_only_and_resume_exactly(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    model = tiny_model("llama")
    overrides: dict[str, Mapping[str, object]] = {
        "optim": {"lr": 1e-2},
        "run": {"steps": 3, "checkpoint_every": 3},
    }
    straight = _trainer(_lora_config(model, tmp_path / "a", **overrides))
    expected = straight.run()
    straight.close()
    killed = _trainer(_lora_config(model, tmp_path / "b", **overrides))

    def kill_after_two(metrics: dict[str, float]) -> None:
        if metrics["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    killed.run(on_step=kill_after_two)
    killed.close()
    saved = saved_model(tmp_path / "b" / "tiny" / "checkpoints" / "step-000002")
    assert saved and all(key.startswith(("lora_a.", "lora_b.")) for key in saved)
    resumed = _trainer(_lora_config(model, tmp_path / "b", **overrides), resume=True)
    rest = resumed.run()
    resumed.close()
    assert [m["step"] for m in rest] == [3]
    assert rest[0]["reward"] == pytest.approx(expected[2]["reward"], abs=1e-9)
    assert rest[0]["learner/loss"] == pytest.approx(expected[2]["learner/loss"], abs=1e-6)
    for (name, a), (_, b) in zip(
        straight.learner.trainable.named_parameters(),
        resumed.learner.trainable.named_parameters(),
        strict=True,
    ):
        assert torch.allclose(a, b, atol=1e-6), name


def test_lora_section_round_trips_through_the_run_config(tiny_model: Callable[[str], Path]) -> None:
    config = _lora_config(tiny_model("llama"), Path("runs"))
    assert config.model.lora == LoraSection(**LORA)
    assert parse_config(tomllib.loads(dump_config(config))) == config


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"target_modules": ["lm_head"]}, r"target_modules \['lm_head'\]: expected some of q_proj"),
        ({"target_modules": ["q_proj", "q_proj"]}, r"name each projection once"),
        ({"target_modules": []}, r"target_modules"),
        ({"r": 0}, r"model.lora.r = 0"),
        ({"dropout": 1.0}, r"model.lora.dropout = 1.0"),
        ({"rank": 8}, r"unknown key 'model.lora.rank'"),
    ],
)
def test_bad_lora_settings_are_named(lora: dict[str, Any], message: str) -> None:
    raw = {"envs": {"weights": {"math/arithmetic": 1.0}}, "model": {"lora": lora}}
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)
