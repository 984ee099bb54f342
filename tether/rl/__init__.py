"""RL post-training: GRPO-family advantages and losses, rollouts from environment mixtures, the learner,
and the sync/async trainer with checkpoints. See `trainer.py` for how the parts fit together."""

from tether.rl.advantages import (
    AdvantageKind,
    compute_advantages,
    group_advantages,
    informative_groups,
    overlong_penalty,
)
from tether.rl.builders import build_trainer
from tether.rl.config import TrainConfig, dump_config, load_config, parse_config
from tether.rl.learner import Learner, LearnStats
from tether.rl.losses import Aggregation, LossConfig, LossOutput, Normaliser, policy_loss
from tether.rl.retries import InfraFailureRateError, RetryPolicy
from tether.rl.rollout import PromptPlan, Rollout, generate_groups, plan_prompts, score_groups
from tether.rl.samples import Sample
from tether.rl.trainer import Trainer, to_samples

__all__ = [
    "AdvantageKind",
    "Aggregation",
    "InfraFailureRateError",
    "LearnStats",
    "Learner",
    "LossConfig",
    "LossOutput",
    "Normaliser",
    "PromptPlan",
    "RetryPolicy",
    "Rollout",
    "Sample",
    "TrainConfig",
    "Trainer",
    "build_trainer",
    "compute_advantages",
    "dump_config",
    "generate_groups",
    "group_advantages",
    "informative_groups",
    "load_config",
    "overlong_penalty",
    "parse_config",
    "plan_prompts",
    "policy_loss",
    "score_groups",
    "to_samples",
]
