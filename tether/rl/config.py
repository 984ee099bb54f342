"""`TrainConfig`: every setting of an RL run, one section per concern, read from TOML and validated.

Unknown keys and out-of-range values fail with the key, the value and what is accepted. The file is
copied verbatim into the run directory (`config.toml`), so a run can always be repeated or resumed.
This module reads no model and starts nothing.
"""

from __future__ import annotations

import json
import tomllib
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError, model_validator

from tether.errors import ConfigError
from tether.models.memory_plan import Strategy
from tether.models.precision import DType
from tether.rl.advantages import AdvantageKind
from tether.rl.cluster_sections import LearnerSection, RaySection
from tether.rl.report_sections import CostSection, MonitorsSection
from tether.rl.reward_sections import RewardSection
from tether.rl.sections import (
    AUTO_SYNC,
    WEIGHT_SYNCS,
    AgentsSection,
    AlgorithmSection,
    Backend,
    EnvsSection,
    ModelSection,
    OptimSection,
    RolloutBackend,
    RolloutSection,
    RunSection,
    Section,
    WeightSync,
)


class TrainConfig(Section):
    model: ModelSection = Field(default_factory=lambda: ModelSection())
    envs: EnvsSection
    rollout: RolloutSection = Field(default_factory=lambda: RolloutSection())
    algorithm: AlgorithmSection = Field(default_factory=lambda: AlgorithmSection())
    optim: OptimSection = Field(default_factory=lambda: OptimSection())
    run: RunSection = Field(default_factory=lambda: RunSection())
    ray: RaySection = Field(default_factory=lambda: RaySection())
    learner: LearnerSection = Field(default_factory=lambda: LearnerSection())
    agents: AgentsSection = Field(default_factory=lambda: AgentsSection())
    rewards: list[RewardSection] = Field(
        default_factory=list,
        description="[[rewards]] tables: judge or reward-model components added to environments of the "
        "mixture (`reward_sections.py`); none: each environment's own rubric alone.",
    )
    cost: CostSection = Field(default_factory=lambda: CostSection())
    monitors: MonitorsSection = Field(default_factory=lambda: MonitorsSection())

    @property
    def rollout_backend(self) -> RolloutBackend:
        """Where rollouts come from: rollout.backend, or by default the learner's run.backend."""
        return self.rollout.backend or RolloutBackend(self.run.backend.value)

    @property
    def weight_sync(self) -> WeightSync:
        """rollout.weight_sync with `auto` resolved for the rollout backend (its value checked on reading)."""
        chosen = self.rollout.weight_sync
        return AUTO_SYNC[self.rollout_backend] if chosen is WeightSync.AUTO else chosen

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        learner = self.learner
        if learner.strategy is Strategy.SINGLE and learner.world_size > 1:
            raise ValueError(
                f"learner.world_size = {learner.world_size} with learner.strategy = 'single': "
                "set learner.strategy = 'fsdp' to train on several ranks"
            )
        if learner.context_parallel > 1:
            if learner.strategy is not Strategy.FSDP:
                raise ValueError(
                    f"learner.context_parallel = {learner.context_parallel} with learner.strategy = "
                    f"'single': context parallelism splits sequences over the ranks of learner.strategy = "
                    f"'fsdp' (learner.world_size a multiple of it)"
                )
            if learner.world_size % learner.context_parallel:
                raise ValueError(
                    f"learner.context_parallel = {learner.context_parallel} does not divide "
                    f"learner.world_size = {learner.world_size}: each group of context_parallel ranks "
                    f"splits one micro-batch, so world_size must be a multiple of it"
                )
            if self.run.backend is Backend.RAY:
                raise ValueError(
                    f"learner.context_parallel = {learner.context_parallel} with run.backend = 'ray': "
                    "context-parallel ranks are started by tether or torchrun (run.backend = 'local')"
                )
        if learner.strategy is Strategy.FSDP:
            if self.model.dtype is DType.FLOAT16:
                # Loss scaling skips a step whose gradients overflowed: every rank would have to agree.
                raise ValueError(
                    "model.dtype = 'float16' with learner.strategy = 'fsdp': the sharded learner does not "
                    "scale the loss; use bfloat16 (float32's range, no scaling) or learner.strategy = "
                    "'single'"
                )
            if self.model.lora is not None:
                # The adapters are a few MiB: sharding them saves nothing worth a second code path.
                raise ValueError(
                    "learner.strategy = 'fsdp' with [model.lora]: LoRA trains with "
                    "learner.strategy = 'single'"
                )
        if self.run.backend is Backend.RAY and self.rollout.backend is RolloutBackend.LOCAL:
            raise ValueError(
                "rollout.backend = 'local' runs the engine in the learner's process, which run.backend = "
                "'ray' puts in an actor: use rollout.backend = 'ray' (engines as actors) or run.backend = "
                "'local'"
            )
        actors = {"ray.learner_gpus": self.run.backend is Backend.RAY}
        actors["ray.rollout_gpus"] = self.rollout_backend is RolloutBackend.RAY
        if any(actors.values()) and self.model.device.startswith("cuda"):
            where = "run.backend = 'ray'" if self.run.backend is Backend.RAY else "rollout.backend = 'ray'"
            # Ray gives each actor its own CUDA_VISIBLE_DEVICES: "cuda" is whatever GPU it was granted.
            if self.model.device != "cuda":
                raise ValueError(
                    f"model.device = {self.model.device!r} with {where}: use 'cuda' or 'auto' "
                    "(Ray assigns each actor its GPU) or 'cpu'"
                )
            gpus = {key: getattr(self.ray, key.removeprefix("ray.")) for key, on in actors.items() if on}
            if 0 in gpus.values():
                raise ValueError(
                    f"model.device = 'cuda' with {where} needs {' and '.join(f'{k} > 0' for k in gpus)} "
                    f"(got {' and '.join(str(v) for v in gpus.values())})"
                )
        allowed = WEIGHT_SYNCS[self.rollout_backend]
        if self.rollout.weight_sync not in allowed:
            raise ValueError(
                f"rollout.weight_sync = {str(self.rollout.weight_sync)!r} does not apply to rollout.backend "
                f"= {str(self.rollout_backend)!r}, which accepts {', '.join(repr(str(w)) for w in allowed)}"
            )
        agent_envs = [name for name in self.envs.weights if name.split("/", 1)[0] == "agent"]
        if agent_envs and self.rollout_backend is not RolloutBackend.LOCAL:
            raise ValueError(
                f"envs.weights {agent_envs}: agent tasks run through the agents' TaskRunner on our engine in "
                f"this process; use rollout.backend = 'local', not {str(self.rollout_backend)!r}"
            )
        if agent_envs and len(agent_envs) < len(self.envs.weights):
            raise ValueError(
                f"envs.weights mixes agent task families {agent_envs} with other environments: train "
                "agent tasks in a mixture of their own"
            )
        if self.algorithm.advantage is AdvantageKind.RLOO and self.rollout.samples_per_prompt < 2:
            raise ValueError("algorithm.advantage = 'rloo' needs rollout.samples_per_prompt >= 2")
        if self.algorithm.overlong_buffer_tokens > self.rollout.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer_tokens = {self.algorithm.overlong_buffer_tokens} exceeds "
                f"rollout.max_new_tokens = {self.rollout.max_new_tokens}"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return self.run.out_dir / self.run.name


_SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelSection,
    "envs": EnvsSection,
    "rollout": RolloutSection,
    "algorithm": AlgorithmSection,
    "optim": OptimSection,
    "run": RunSection,
    "ray": RaySection,
    "learner": LearnerSection,
    "agents": AgentsSection,
    "cost": CostSection,
    "monitors": MonitorsSection,
}
_TABLE_LISTS: dict[str, type[BaseModel]] = {"rewards": RewardSection}  # [[name]] tables


def parse_config(raw: dict[str, Any], source: str = "config") -> TrainConfig:
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as error:
        lines = []
        for problem in error.errors():
            loc = problem["loc"]
            if loc[:1] == ("rewards",) and len(loc) > 1:  # [[rewards]] table N: "rewards[N].key"
                loc = (f"rewards[{loc[1]}]", *loc[2:])
            key = ".".join(str(part) for part in loc) or "(root)"
            if problem["type"] == "extra_forbidden":
                tables = {**_SECTIONS, **_TABLE_LISTS}
                section = tables.get(str(loc[0]).split("[")[0]) if len(loc) == 2 else None
                known = sorted((section or TrainConfig).model_fields)
                lines.append(f"{source}: unknown key {key!r}; known keys: {', '.join(known)}")
            elif problem["type"] == "value_error":
                where = f"{loc[0]}: " if loc and str(loc[0]).startswith("rewards[") else ""
                lines.append(f"{source}: {where}{problem['msg'].removeprefix('Value error, ')}")
            else:
                lines.append(f"{source}: {key} = {problem['input']!r}: {problem['msg']}")
        raise ConfigError("\n".join(lines)) from None


def load_config(path: Path) -> TrainConfig:
    if not path.is_file():
        raise ConfigError(f"train config {str(path)!r} does not exist")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"train config {str(path)!r} is not valid TOML: {error}") from None
    return parse_config(raw, str(path))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return json.dumps(value.value)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return json.dumps(str(value))  # JSON string escapes are valid TOML basic-string escapes


def _table_lines(header: str, table: BaseModel) -> list[str]:
    """`header` and a table's keys, then its sub-tables ([header.key]); unset (None) keys left out."""
    lines = [header]
    tables: list[tuple[str, dict[str, Any]]] = []
    for key in type(table).model_fields:
        value = getattr(table, key)
        if value is None:
            continue
        if isinstance(value, BaseModel):  # a sub-section: [section.key]
            tables.append((key, {k: v for k, v in value.model_dump().items() if v is not None}))
        elif isinstance(value, dict):
            tables.append((key, value))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    name = header.strip("[]")
    for key, values in tables:
        lines.append(f"\n[{name}.{key}]")
        lines.extend(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in values.items())
    lines.append("")
    return lines


def dump_config(config: TrainConfig) -> str:
    """The config as TOML that `load_config` reads back to an equal config (written to the run dir)."""
    lines: list[str] = []
    for section_name in _SECTIONS:
        lines.extend(_table_lines(f"[{section_name}]", getattr(config, section_name)))
    for list_name in _TABLE_LISTS:
        for table in getattr(config, list_name):
            lines.extend(_table_lines(f"[[{list_name}]]", table))
    return "\n".join(lines)
