"""Verifiable environments: tasks, parsers, rubrics, episodes and the registry of domains (their tools
are `tether.tools`)."""

from tether.chat import Message, Messages, ToolCall, ToolSpec
from tether.envs.context import SandboxProvider, ScoringContext
from tether.envs.episode import (
    Environment,
    Episode,
    EpisodeResult,
    Policy,
    StepValidator,
    run_episode,
    scripted_policy,
)
from tether.envs.errors import EnvError
from tether.envs.parsers import ANSWER_TAG, TagParser
from tether.envs.registry import (
    BUILTIN_FAMILIES,
    ENTRY_POINT_GROUP,
    EnvInfo,
    EnvRegistry,
    Mixture,
    default_registry,
    load_mixture,
    parse_env_spec,
)
from tether.envs.rubric import answer_rubric, format_followed, length_within
from tether.envs.scoring import EpisodeState, Reward, RewardInput, Rubric, Score
from tether.envs.tasks import ChatRenderer, Parsed, Parser, Problem, Renderer, Task, TaskSource

__all__ = [
    "ANSWER_TAG",
    "BUILTIN_FAMILIES",
    "ENTRY_POINT_GROUP",
    "ChatRenderer",
    "EnvError",
    "EnvInfo",
    "EnvRegistry",
    "Environment",
    "Episode",
    "EpisodeResult",
    "EpisodeState",
    "Message",
    "Messages",
    "Mixture",
    "Parsed",
    "Parser",
    "Policy",
    "Problem",
    "Renderer",
    "Reward",
    "RewardInput",
    "Rubric",
    "SandboxProvider",
    "Score",
    "ScoringContext",
    "StepValidator",
    "TagParser",
    "Task",
    "TaskSource",
    "ToolCall",
    "ToolSpec",
    "answer_rubric",
    "default_registry",
    "format_followed",
    "length_within",
    "load_mixture",
    "parse_env_spec",
    "run_episode",
    "scripted_policy",
]
