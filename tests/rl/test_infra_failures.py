"""Runs that meet infrastructure failures: a sandbox worker killed mid-scoring is retried and the run trains
every sample it asked for; too many failures stop the run before it learns; a source's counters are
recorded. Tiny random models, a real engine, and a real sandbox where the test is about the sandbox."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tether.engine.llm_engine import LLMEngine
from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.registry import EnvRegistry
from tether.envs.scoring import RewardInput
from tether.models import load
from tether.rl.builders import learner_options, open_run
from tether.rl.config import TrainConfig
from tether.rl.learner import Learner
from tether.rl.retries import InfraFailureRateError, RetryPolicy
from tether.rl.rollout import PromptPlan
from tether.rl.sources import EngineRollouts, Generated
from tether.rl.trainer import Trainer, sampling_params
from tether.sandbox import PoolConfig, SandboxPool, SandboxSpec

from .fake_envs import fake_registry, reward_env
from .test_trainer import tiny_config

BLOCKS = "import time\ntime.sleep(60)"  # a scorer program that never finishes on its own


def _trainer(config: TrainConfig, registry: EnvRegistry, ctx: ScoringContext) -> Trainer:
    torch.manual_seed(config.run.seed)
    engine, tokenizer = LLMEngine.from_pretrained(config.model.name, kv_cache_mib=config.model.kv_cache_mib)
    model, _, _ = load(config.model.name)
    learner = Learner(model, **learner_options(config))
    params, retry = sampling_params(config.rollout), RetryPolicy.of(config.rollout)
    source = EngineRollouts(engine, tokenizer, registry, ctx, params, retry=retry)
    return open_run(Trainer(config, engine, tokenizer, learner, registry, ctx, rollouts=source), False)


def _metrics(config: TrainConfig) -> list[dict[str, float]]:
    path = config.run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def _kill_the_busy_worker(pool: SandboxPool) -> None:
    """SIGKILL the worker running the (blocking) program once it has been running a moment."""
    await asyncio.sleep(0.5)
    (busy,) = [worker for worker in pool._workers if worker not in pool._idle + pool._spares]
    assert busy.process is not None
    os.kill(busy.process.pid, signal.SIGKILL)


def _sandboxed_registry() -> EnvRegistry:
    """`test/sandboxed`: every answer is scored by a program in the sandbox, one at a time; the first
    scoring's program blocks, and its worker is killed under it."""
    one_at_a_time = asyncio.Lock()
    killed: list[bool] = []

    async def runs_in_the_sandbox(inp: RewardInput) -> float:
        async with one_at_a_time:  # so that the one busy worker is the blocking program's
            pool = await inp.ctx.pool()
            assert isinstance(pool, SandboxPool)
            program = f"print({len(inp.completion)} % 2)"
            killer = None
            if not killed:
                killed.append(True)
                program = BLOCKS
                killer = asyncio.create_task(_kill_the_busy_worker(pool))
            try:
                result = await inp.ctx.run(program)
            finally:
                if killer is not None:
                    await killer
            return 0.25 + 0.5 * float(result.stdout.strip())

    registry = EnvRegistry()
    registry.add(reward_env("test/sandboxed", runs_in_the_sandbox))
    return registry


def test_a_sandbox_worker_killed_mid_scoring_is_retried_and_every_sample_trains(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    config = tiny_config(
        tiny_model("qwen3"),
        tmp_path,
        envs={"weights": {"test/sandboxed": 1.0}},
        rollout={"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 4},
        run={"steps": 2, "checkpoint_every": 100},
    )
    provider = SandboxProvider(SandboxSpec(timeout_s=30), PoolConfig(slots=1))
    trainer = _trainer(config, _sandboxed_registry(), ScoringContext(provider))
    try:
        history = trainer.run(final_checkpoint=False)
    finally:
        trainer.close()
    assert [m["trained_sequences"] for m in history] == [4, 4]  # all that was asked, nothing lost
    first, second = _metrics(config)
    assert first["rollout/retried"] == 1 and first["rollout/retried/sandbox_error"] == 1
    assert first["rollout/infra_failed"] == 0 and second["rollout/retried"] == 0


def _always(value: float) -> EnvRegistry:
    registry = EnvRegistry()
    registry.add(reward_env("test/broken", lambda _inp: value))
    return registry


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_too_many_infra_failures_stop_the_run_before_it_learns(
    tiny_model: Callable[[str], Path], tmp_path: Path, mode: str
) -> None:
    config = tiny_config(
        tiny_model("qwen3"),
        tmp_path,
        envs={"weights": {"test/broken": 1.0}},
        rollout={"prompts_per_step": 2, "samples_per_prompt": 2, "infra_retries": 1},
        run={"steps": 2, "mode": mode},
    )
    trainer = _trainer(config, _always(math.nan), ScoringContext())
    before = {name: p.detach().clone() for name, p in trainer.learner.model.named_parameters()}
    try:
        with pytest.raises(InfraFailureRateError, match=r"4 of 4 rollouts \(100%\).*invalid_reward 4"):
            trainer.run()
    finally:
        trainer.close()
    assert trainer.step == 0 and _metrics(config) == []  # nothing of the step was learned or recorded
    for name, param in trainer.learner.model.named_parameters():
        assert torch.equal(before[name], param.detach())


class _CountingSource:
    """A rollout source that reports events of its own (as Ray and server sources do)."""

    def __init__(self, inner: EngineRollouts, counters: Mapping[str, float]) -> None:
        self.inner, self.counters = inner, dict(counters)

    def generate(self, plans: Sequence[PromptPlan]) -> Generated:
        return replace(self.inner.generate(plans), counters=self.counters)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.inner.load(weights, version)

    def close(self) -> None:
        self.inner.close()


def test_a_sources_counters_reach_the_steps_metrics(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    one_group = {"prompts_per_step": 1, "samples_per_prompt": 2}
    config = tiny_config(tiny_model("qwen3"), tmp_path, rollout=one_group, run={"steps": 1})
    trainer = _trainer(config, fake_registry(), ScoringContext())
    assert isinstance(trainer.rollouts, EngineRollouts)
    counters = {"rollout/retried/worker_lost": 3.0, "rollout/workers_replaced": 1.0}
    trainer.rollouts = _CountingSource(trainer.rollouts, counters)
    try:
        trainer.run(final_checkpoint=False)
    finally:
        trainer.close()
    (recorded,) = _metrics(config)
    assert recorded["rollout/workers_replaced"] == 1 and recorded["rollout/retried/worker_lost"] == 3
    assert recorded["rollout/retried"] == 3  # the total counts the source's retries too
