"""`tether train --plan`: the per-rank memory of a training configuration, printed without allocating.

The model comes from the config's `[model] name` or `--model` (a preset architecture such as llama-3-8b
or qwen2.5-72b, or a local Hugging Face folder); the micro-batch from `[optim]` and `[rollout]`. What
each row means is `tether.models.memory_plan`'s docstring. A rich table on a terminal, plain lines
otherwise, one JSON object with `--json`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from tether.models.memory_plan import MemoryPlan
    from tether.rl.config import TrainConfig

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """The command line's overrides of the config (None: the config's value, or its default)."""

    model: str | None = None
    strategy: str | None = None
    world_size: int | None = None
    dtype: str | None = None
    prompt_tokens: int = 256
    activation_checkpointing: bool = False
    kv_cache_tokens: int | None = None
    engine: bool = True


def build_plan(config: TrainConfig | None, options: PlanOptions) -> MemoryPlan:
    """The plan of `config` (None: every section's defaults) with the command line's overrides."""
    from tether.errors import ConfigError
    from tether.models.memory_plan import MicroBatch, PlanSettings, Strategy, plan_memory
    from tether.models.precision import DType
    from tether.models.presets import architecture
    from tether.rl.cluster_sections import LearnerSection
    from tether.rl.sections import ModelSection, OptimSection, RolloutSection

    model = config.model if config is not None else ModelSection()
    optim = config.optim if config is not None else OptimSection()
    rollout = config.rollout if config is not None else RolloutSection()
    learner = config.learner if config is not None else LearnerSection()
    name = options.model or model.name
    strategy = learner.strategy
    if options.strategy is not None:
        try:
            strategy = Strategy(options.strategy)
        except ValueError:
            accepted = ", ".join(s.value for s in Strategy)
            raise ConfigError(f"--strategy {options.strategy!r}: expected one of {accepted}") from None
    world_size = options.world_size if options.world_size is not None else learner.world_size
    dtype = DType.parse(options.dtype, "--dtype") if options.dtype is not None else model.dtype
    micro_batch = MicroBatch.of(
        optim.micro_batch,
        rollout.samples_per_prompt,
        options.prompt_tokens,
        rollout.max_new_tokens,
        optim.micro_batch_tokens,
    )
    # By default the engine holds one step's rollouts at once; its shared-prefix cache needs less.
    step_tokens = (
        rollout.prompts_per_step
        * rollout.samples_per_prompt
        * (options.prompt_tokens + rollout.max_new_tokens)
    )
    settings = PlanSettings(
        strategy=strategy,
        world_size=world_size,
        dtype=dtype,
        micro_batch=micro_batch,
        activation_checkpointing=options.activation_checkpointing or learner.activation_checkpointing,
        kv_cache_tokens=options.kv_cache_tokens if options.kv_cache_tokens is not None else step_tokens,
        engine=options.engine,
    )
    return plan_memory(name, architecture(name), settings)


def _gib(count: int) -> str:
    return f"{count / GIB:.2f} GiB"


def _heading(plan: MemoryPlan) -> str:
    s = plan.settings
    micro = s.micro_batch
    checkpointing = ", activation checkpointing" if s.activation_checkpointing else ""
    return (
        f"{plan.model}: {plan.parameter_count / 1e9:.2f}B parameters, {s.strategy.value} over "
        f"{s.world_size} rank(s), {s.dtype.value}{checkpointing}; micro-batch {micro.tokens} tokens "
        f"({micro.prompts} x ({micro.prompt_tokens} prompt + {micro.samples} x {micro.completion_tokens}))"
    )


def _labels(plan: MemoryPlan) -> dict[str, str]:
    kv = f"kv_cache ({plan.settings.kv_cache_tokens} tokens)" if plan.settings.engine else "kv_cache"
    return {category: category for category in plan.bytes} | {"kv_cache": kv}


def print_plan(plan: MemoryPlan, as_json: bool, out: Console) -> None:
    if as_json:
        out.print(json.dumps(plan.to_dict()), highlight=False, soft_wrap=True)
        return
    labels = _labels(plan)
    if not out.is_terminal:
        out.print(_heading(plan), highlight=False, soft_wrap=True)
        for category, size in plan.bytes.items():
            out.print(f"{labels[category]} {_gib(size)}", highlight=False, soft_wrap=True)
        out.print(f"total per rank {_gib(plan.total)}", highlight=False, soft_wrap=True)
        return
    table = Table(title=_heading(plan), title_justify="left")
    table.add_column("per rank")
    table.add_column("memory", justify="right")
    for category, size in plan.bytes.items():
        table.add_row(labels[category], _gib(size))
    table.add_row("total", _gib(plan.total), style="bold")
    out.print(table)
