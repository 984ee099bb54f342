"""A few sync steps end to end on a tiny model: rollouts, advantages, updates, pushes and metrics."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch

from tether.engine.llm_engine import LLMEngine
from tether.envs.context import ScoringContext
from tether.models import load
from tether.models.threads import available_cores
from tether.rl.builders import learner_options, open_run
from tether.rl.config import TrainConfig, parse_config
from tether.rl.learner import Learner
from tether.rl.trainer import Trainer

from .fake_envs import fake_registry


def tiny_config(model: Path, out_dir: Path, **sections: Mapping[str, object]) -> TrainConfig:
    raw: dict[str, dict[str, object]] = {
        "model": {"name": str(model), "kv_cache_mib": 8},
        "envs": {"weights": {"test/vowels": 1.0, "test/digits": 1.0}},
        "rollout": {"prompts_per_step": 3, "samples_per_prompt": 4, "max_new_tokens": 8},
        "optim": {"lr": 1e-3, "micro_batch": 6},
        "run": {"name": "tiny", "out_dir": str(out_dir), "steps": 3, "checkpoint_every": 2, "seed": 7},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return parse_config(raw)


def make_trainer(config: TrainConfig, resume: bool = False) -> Trainer:
    torch.manual_seed(config.run.seed)
    engine, tokenizer = LLMEngine.from_pretrained(config.model.name, kv_cache_mib=config.model.kv_cache_mib)
    model, _, _ = load(config.model.name)
    learner = Learner(model, **learner_options(config))
    return open_run(Trainer(config, engine, tokenizer, learner, fake_registry(), ScoringContext()), resume)


def test_three_sync_steps_learn_push_and_record_per_domain(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    config = tiny_config(tiny_model("qwen3"), tmp_path)
    trainer = make_trainer(config)
    before = {n: p.detach().clone() for n, p in trainer.learner.model.named_parameters()}
    history = trainer.run()
    trainer.close()
    assert [m["step"] for m in history] == [1, 2, 3]
    assert [m["policy_version"] for m in history] == [1, 2, 3]
    for metrics in history:
        # Sync mode is on-policy: the learner's recomputed logprobs equal the engine's recorded ones.
        assert metrics["learner/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert metrics["staleness_max"] == 0
        assert metrics["rollouts"] == 12
        per_domain = [metrics.get(f"domain/test/{d}/rollouts", 0) for d in ("vowels", "digits")]
        assert sum(per_domain) == 12
        assert {"reward/share", "reward/short", "truncation_rate", "response_tokens"} <= set(metrics)
        assert metrics["time/generate_s"] > 0 and metrics["time/learn_s"] > 0
        # The thread count each step ran with, following the free cores (run.adapt_threads).
        assert 1 <= metrics["run/threads"] <= available_cores()
        assert metrics["run/threads_learner"] == metrics["run/threads"]  # sync: one thread runs it all
    assert any(m.get("domain/test/vowels/reward/share", 0) > 0 for m in history)
    # The weights moved, and the engine generates with exactly the learner's weights.
    assert trainer.engine is not None
    engine_params = dict(trainer.engine.named_parameters())
    moved = 0
    for name, param in trainer.learner.model.named_parameters():
        assert torch.equal(engine_params[name], param.detach())
        moved += not torch.equal(before[name], param.detach())
    assert moved == len(before)
    lines = (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert (tmp_path / "tiny" / "config.toml").is_file()
    assert (tmp_path / "tiny" / "checkpoints" / "step-000003").is_dir()
    transcripts = [
        json.loads(line) for line in (tmp_path / "tiny" / "transcripts.jsonl").read_text().splitlines()
    ]
    assert len(transcripts) == 6 and {"text", "reward", "components", "prompt"} <= set(transcripts[0])


@pytest.mark.parametrize(
    ("run", "hooked"),
    [({"mode": "sync"}, True), ({"mode": "async"}, False), ({"mode": "sync", "adapt_threads": False}, False)],
)
def test_the_engine_follows_the_trainers_governor_when_it_steps_on_the_trainers_thread(
    tiny_model: Callable[[str], Path], tmp_path: Path, run: Mapping[str, object], hooked: bool
) -> None:
    """Sync mode generates on the trainer's thread: its engine consults the same governor before each
    step. Async mode splits the count between two threads itself; without adapt_threads nothing moves."""
    trainer = make_trainer(tiny_config(tiny_model("qwen3"), tmp_path, run=run))
    try:
        assert trainer.engine is not None
        governor = trainer.threads.governor
        assert (governor is not None) is run.get("adapt_threads", True)
        assert (trainer.engine.runner.governor is governor and governor is not None) is hooked
    finally:
        trainer.close()
