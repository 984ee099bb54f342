"""How a run is put together: the rollout engine, the learner (single or rank 0 of a sharded one), the
rollout source `[rollout] backend` names, and the `Trainer` over them with its run directory opened.

`build_trainer` is the one entry `tether train`, the demo and the benchmarks use; the Ray backend
(`ray_backend.py`) and its actors reuse the pieces (`make_engine`, `make_learner`, `learner_options`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import torch

from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.registry import EnvRegistry, default_registry, mixture_from_weights
from tether.envs.verifiers_env import VerifiersSpec, register_verifiers
from tether.models.memory_plan import Strategy
from tether.models.precision import resolve_device
from tether.models.threads import strict_matmul
from tether.rl.agent_rollouts import register_agent_families
from tether.rl.config import TrainConfig
from tether.rl.learner import Learner
from tether.rl.remote_rollouts import server_rollouts
from tether.rl.retries import RetryPolicy
from tether.rl.rewards import add_reward_components
from tether.rl.sections import AgentJournal, Backend, RolloutBackend
from tether.rl.sources import EngineRollouts, RolloutSource
from tether.rl.trainer import Trainer, sampling_params

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tether.engine.llm_engine import LLMEngine
    from tether.rl.distributed import LearnerGroup


def make_engine(config: TrainConfig, device: str) -> tuple[LLMEngine, PreTrainedTokenizerBase]:
    """The rollout engine of `config` on `device` (in this process or a rollout worker's)."""
    from tether.engine.llm_engine import LLMEngine

    model_config = config.model
    return LLMEngine.from_pretrained(
        model_config.name,
        cache_dir=model_config.cache_dir,
        kv_cache_mib=model_config.kv_cache_mib,
        max_model_len=model_config.max_model_len,
        rope_scaling=model_config.rope(),
        device=resolve_device(device, "model.device"),
        dtype=model_config.dtype.torch,
        seed=config.run.seed,
    )


TrainerT = TypeVar("TrainerT", bound=Trainer)


def open_run(trainer: TrainerT, resume: bool) -> TrainerT:
    """`trainer` with its run directory started (or its latest checkpoint loaded); closed if that fails."""
    try:
        trainer.start_run_dir(resume)
    except BaseException:
        trainer.close()
        raise
    return trainer


def learner_options(config: TrainConfig) -> dict[str, Any]:
    """The `Learner` arguments `config` alone fixes: shared by the learner and the Ray driver's copy of
    its state (which never computes, so it takes no reference model and no compute dtype)."""
    return {
        "optim": config.optim,
        "loss": config.algorithm.loss(),
        "total_steps": config.run.steps,
        "temperature": config.rollout.temperature,
        "max_new_tokens": config.rollout.max_new_tokens,
        "lora": config.model.lora,
        "tis_cap": config.algorithm.tis_cap,
        "mismatch_correction": config.algorithm.mismatch_correction,
        "mismatch_cap": config.algorithm.mismatch_cap,
        "async_checkpoint": config.learner.async_checkpoint,
    }


def make_learner(config: TrainConfig, device: str, group: LearnerGroup | None = None) -> Learner:
    """The learner of `config` on `device` (in this process or the Ray learner actor's); with
    `learner.strategy = "fsdp"`, this rank's `ShardedLearner` over `group`."""
    from tether.models import load

    model_config = config.model
    where = resolve_device(device, "model.device")
    # float32 master weights whatever model.dtype says: the learner computes in model.dtype (autocast);
    # the engine's rope scaling, or its logprobs would not be the learner's
    rope = model_config.rope()
    model, _, _ = load(model_config.name, model_config.cache_dir, device=where, rope_scaling=rope)
    reference = None
    if config.algorithm.kl_coef > 0:
        reference, _, _ = load(model_config.name, model_config.cache_dir, device=where, rope_scaling=rope)
    if config.learner.strategy is Strategy.FSDP:
        from tether.rl.sharded import ShardedLearner

        assert group is not None, "a sharded learner needs its process group"
        return ShardedLearner(
            model,
            group,
            config.learner,
            compute_dtype=model_config.dtype.torch,
            reference=reference,
            **learner_options(config),
        )
    return Learner(
        model, reference=reference, compute_dtype=model_config.dtype.torch, **learner_options(config)
    )


def open_learner(config: TrainConfig) -> Learner:
    """This process's learner; with `learner.strategy = "fsdp"`, rank 0 of its group (torchrun's ranks,
    or ranks 1..N-1 started here), the group closed again if the learner cannot be made."""
    if config.learner.strategy is not Strategy.FSDP:
        return make_learner(config, config.model.device)
    from tether.rl.ranks import open_learner_group

    group = open_learner_group(config)
    try:
        return make_learner(config, str(group.device), group)
    except BaseException:
        group.close()
        raise


def training_registry(config: TrainConfig, registry: EnvRegistry | None = None) -> EnvRegistry:
    """The environments a run draws from: `registry` (default: every built-in and plug-in), the
    agent task families (`agent/*`, rolled out through the agents' runner by `agent_rollouts.py`) and
    the `verifiers` environments of `[envs.verifiers]` (`vf/*`, imported when first looked up), with
    the `[[rewards]]` components added to the rubrics they name (`rewards.py`)."""
    registry = registry or default_registry()
    register_agent_families(registry, config.agents.max_steps)
    if config.envs.verifiers:
        specs = {
            key: VerifiersSpec(env.module, dict(env.args), env.max_turns, env.reward_range)
            for key, env in config.envs.verifiers.items()
        }
        register_verifiers(registry, specs)
    add_reward_components(registry, config)
    return registry


def build_trainer(
    config: TrainConfig,
    registry: EnvRegistry | None = None,
    sandbox: SandboxProvider | None = None,
    resume: bool = False,
) -> Trainer:
    """Load the learner's model, a frozen reference (when KL is on) and the rollout engine; open the run.

    Rollouts come from where `config.rollout_backend` says (`sources.py`); with `run.backend = "ray"` or
    `rollout.backend = "ray"` the learner or the rollout engines are Ray actors (`ray_backend.py`)."""
    registry = training_registry(config, registry)
    mixture_from_weights(registry, config.envs.weights)  # unknown names fail before any model loads
    if config.model.strict_matmul:
        strict_matmul()
    if config.run.backend is Backend.RAY or config.rollout_backend is RolloutBackend.RAY:
        from tether.rl.ray_backend import build_ray_trainer  # imports Ray: only for the runs that use it

        return build_ray_trainer(config, registry, sandbox, resume)
    torch.manual_seed(config.run.seed)
    ctx = ScoringContext(sandbox)
    rollouts: RolloutSource | None = None
    if config.rollout_backend.remote:  # checks the mixture before any model loads
        rollouts = server_rollouts(config, registry, ctx, sampling_params(config.rollout))
    try:
        engine, tokenizer = (None, None) if rollouts is not None else make_engine(config, config.model.device)
        learner = open_learner(config)
    except BaseException:
        if rollouts is not None:
            rollouts.close()
        raise
    if rollouts is None:
        assert engine is not None and tokenizer is not None
        agent_state = config.run_dir / "agent_journal" if config.agents.journal is AgentJournal.RUN else None
        params = sampling_params(config.rollout)
        rollouts = EngineRollouts(
            engine,
            tokenizer,
            registry,
            ctx,
            params,
            agent_state_dir=agent_state,
            retry=RetryPolicy.of(config.rollout),
        )
    return open_run(Trainer(config, engine, tokenizer, learner, registry, ctx, rollouts=rollouts), resume)
