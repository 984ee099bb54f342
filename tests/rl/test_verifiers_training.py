"""verifiers environments, written with verifiers' own classes and named in `[envs.verifiers]`, train."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.envs.verifiers_fixtures import (
    QUESTIONS,
    Dataset,
    install_module,
    multi_turn_env,
    single_turn_env,
    tool_env,
    vf,
)
from tether.engine.llm_engine import LLMEngine
from tether.envs.context import ScoringContext
from tether.envs.registry import EnvRegistry
from tether.models import load
from tether.rl.builders import learner_options, open_run, training_registry
from tether.rl.config import parse_config
from tether.rl.learner import Learner
from tether.rl.trainer import Trainer


def graded_env() -> object:
    """A SingleTurnEnv whose reward grows with the reply's length: a tiny random model's samples of one
    prompt differ in it, so its groups have advantages and the step really updates the weights."""

    def length(completion: list[dict[str, str]], **kwargs: object) -> float:
        return min(1.0, len(completion[-1]["content"]) / 40)

    return vf.SingleTurnEnv(dataset=Dataset.from_list(QUESTIONS), rubric=vf.Rubric(funcs=[length]))


# vf/<name> -> the loader its Hub-style module exposes as load_environment
LOADERS = {"add": single_turn_env, "guess": multi_turn_env, "add-tool": tool_env, "graded": graded_env}


def test_single_multi_turn_and_tool_envs_of_verifiers_train_two_steps(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    modules = {name: f"vf_tether_rl_{name.replace('-', '_')}" for name in LOADERS}
    for name, loader in LOADERS.items():
        install_module(modules[name], load_environment=loader)
    config = parse_config(
        {
            "model": {"name": str(tiny_model("qwen3")), "kv_cache_mib": 8},
            "envs": {
                "weights": {"vf/*": 1.0},
                "verifiers": {name: {"module": module} for name, module in modules.items()},
            },
            "rollout": {"prompts_per_step": 4, "samples_per_prompt": 2, "max_new_tokens": 6},
            "optim": {"lr": 1e-3, "micro_batch": 8},
            "run": {"name": "vf", "out_dir": str(tmp_path), "steps": 2, "checkpoint_every": 2, "seed": 3},
        }
    )
    registry = training_registry(config, EnvRegistry())
    assert registry.names("vf/*") == ["vf/add", "vf/add-tool", "vf/graded", "vf/guess"]
    assert registry.get("vf/guess").multi_turn and registry.info("vf/add-tool").tools == ["add"]
    torch.manual_seed(config.run.seed)
    before = {name: tensor.clone() for name, tensor in load(config.model.name)[0].state_dict().items()}
    engine, tokenizer = LLMEngine.from_pretrained(config.model.name, kv_cache_mib=config.model.kv_cache_mib)
    model, _, _ = load(config.model.name)
    trainer = open_run(
        Trainer(
            config, engine, tokenizer, Learner(model, **learner_options(config)), registry, ScoringContext()
        ),
        False,
    )
    try:
        history = trainer.run()
        after = trainer.learner.model.state_dict()
    finally:
        trainer.close()
    assert sum(m["trained_sequences"] for m in history) > 0  # verifiers' rewards made real advantages
    assert any(not torch.equal(before[name], after[name]) for name in before)  # and the weights moved
    assert [m["step"] for m in history] == [1, 2]
    assert [m["policy_version"] for m in history] == [1, 2]
    for metrics in history:
        assert metrics["rollouts"] == 8
        assert sum(metrics.get(f"domain/vf/{name}/rollouts", 0) for name in LOADERS) == 8
        assert metrics["learner/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    components = {"add": "correct_answer", "guess": "solved", "add-tool": "used_tool", "graded": "length"}
    seen = set()
    for metrics in history:
        for name, component in components.items():
            if metrics.get(f"domain/vf/{name}/rollouts", 0):
                seen.add(name)
                assert metrics[f"domain/vf/{name}/score_errors"] == 0  # every episode scored by its rubric
                assert f"domain/vf/{name}/reward/{component}" in metrics
        if metrics.get("domain/vf/guess/rollouts", 0):
            assert metrics["domain/vf/guess/turns"] > 1  # env_response answered and the model replied again
    assert len(seen) >= 2
