"""`TrainConfig`: every setting of an RL run, one section per concern, read from TOML and validated.

Unknown keys and out-of-range values fail with the key, the value and what is accepted. The file is
copied verbatim into the run directory (`config.toml`), so a run can always be repeated or resumed.
This module reads no model and starts nothing.
"""

from __future__ import annotations

import json
import math
import tomllib
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tether.errors import ConfigError
from tether.rl.advantages import AdvantageKind
from tether.rl.losses import Aggregation, LossConfig


class Mode(StrEnum):
    SYNC = "sync"  # generate, then learn on that batch: strictly on-policy
    ASYNC = "async"  # generate the next batch while learning on this one, within max_staleness


class Schedule(StrEnum):
    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    name: str = Field("smollm2-135m-instruct", description="Registered model name or a local HF folder.")
    cache_dir: Path | None = Field(None, description="Model cache (default: the tether settings' cache).")
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:[0-9]+)?)$",
        description="Torch device of learner and engine: cpu, cuda:N.",
    )
    kv_cache_mib: int = Field(256, ge=1, description="Engine KV cache size, MiB.")
    bf16: bool = Field(False, description="Learner forward in bfloat16 autocast (needs a device with bf16).")


class EnvsSection(_Section):
    weights: dict[str, float] = Field(
        min_length=1, description="Environment name or glob -> sampling weight (see `tether envs list`)."
    )
    seed_offset: int = Field(
        0, ge=0, description="Training task seeds are seed_offset + a per-domain cursor (hold out others)."
    )

    @field_validator("weights")
    @classmethod
    def _positive(cls, weights: dict[str, float]) -> dict[str, float]:
        bad = {name: weight for name, weight in weights.items() if not (math.isfinite(weight) and weight > 0)}
        if bad:
            raise ValueError(f"envs.weights {bad}: every weight must be a positive number")
        return weights


class RolloutSection(_Section):
    prompts_per_step: int = Field(8, ge=1, description="Prompts (groups) drawn from the mixture per step.")
    samples_per_prompt: int = Field(4, ge=1, le=256, description="n: completions per prompt (group size).")
    max_new_tokens: int = Field(64, ge=1, description="Longest completion, tokens.")
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature (> 0 for RL).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling; logprobs stay untruncated.")


class AlgorithmSection(_Section):
    advantage: AdvantageKind = Field(AdvantageKind.GRPO, description="grpo, dr_grpo or rloo.")
    aggregation: Aggregation = Field(
        Aggregation.SEQUENCE_MEAN, description="sequence_mean (GRPO), token_mean (DAPO), sequence_sum (Dr.)"
    )
    clip_low: float = Field(0.2, ge=0, lt=1, description="Ratio clipped below at 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0, le=10, description="Ratio clipped above at 1 + clip_high.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of k3 KL to the frozen initial model (0: none).")
    drop_equal_groups: bool = Field(False, description="DAPO dynamic sampling: skip all-equal groups.")
    overlong_buffer_tokens: int = Field(
        0, ge=0, description="DAPO overlong penalty over the last N tokens of max_new_tokens (0: off)."
    )

    def loss(self) -> LossConfig:
        return LossConfig(self.clip_low, self.clip_high, self.aggregation, self.kl_coef)


class OptimSection(_Section):
    lr: float = Field(1e-6, gt=0, le=1, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    max_grad_norm: float = Field(1.0, gt=0, description="Gradients clipped to this global L2 norm.")
    micro_batch: int = Field(
        8, ge=1, description="Sequences per forward/backward; the step accumulates over the batch."
    )
    schedule: Schedule = Field(Schedule.CONSTANT, description="LR after warm-up: constant, linear, cosine.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up from 0 to lr, steps.")


class RunSection(_Section):
    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$", description="Run directory name.")
    out_dir: Path = Field(Path("runs"), description="Runs are written to out_dir/name.")
    steps: int = Field(100, ge=1, description="Training steps (one optimizer update each).")
    seed: int = Field(0, ge=0, description="Seeds task choice, sampling and torch.")
    mode: Mode = Field(Mode.SYNC, description="sync (on-policy) or async (bounded staleness).")
    max_staleness: int = Field(1, ge=0, description="async: most policy versions a rollout may lag.")
    checkpoint_every: int = Field(10, ge=1, description="Checkpoint every N steps (and at the end/SIGTERM).")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk (oldest removed).")
    transcripts_per_step: int = Field(2, ge=0, description="Sampled transcripts written per step.")


class TrainConfig(_Section):
    model: ModelSection = Field(default_factory=lambda: ModelSection())
    envs: EnvsSection
    rollout: RolloutSection = Field(default_factory=lambda: RolloutSection())
    algorithm: AlgorithmSection = Field(default_factory=lambda: AlgorithmSection())
    optim: OptimSection = Field(default_factory=lambda: OptimSection())
    run: RunSection = Field(default_factory=lambda: RunSection())

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
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
}


def parse_config(raw: dict[str, Any], source: str = "config") -> TrainConfig:
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as error:
        lines = []
        for problem in error.errors():
            loc = problem["loc"]
            key = ".".join(str(part) for part in loc) or "(root)"
            if problem["type"] == "extra_forbidden":
                section = _SECTIONS.get(str(loc[0])) if len(loc) == 2 else None
                known = sorted((section or TrainConfig).model_fields)
                lines.append(f"{source}: unknown key {key!r}; known keys: {', '.join(known)}")
            elif problem["type"] == "value_error":
                lines.append(f"{source}: {problem['msg'].removeprefix('Value error, ')}")
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
    return json.dumps(str(value))  # JSON string escapes are valid TOML basic-string escapes


def dump_config(config: TrainConfig) -> str:
    """The config as TOML that `load_config` reads back to an equal config (written to the run dir)."""
    lines: list[str] = []
    for section_name in _SECTIONS:
        section = getattr(config, section_name)
        lines.append(f"[{section_name}]")
        tables: list[tuple[str, dict[str, Any]]] = []
        for key in type(section).model_fields:
            value = getattr(section, key)
            if value is None:
                continue
            if isinstance(value, dict):
                tables.append((key, value))
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        for key, table in tables:
            lines.append(f"\n[{section_name}.{key}]")
            lines.extend(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in table.items())
        lines.append("")
    return "\n".join(lines)
