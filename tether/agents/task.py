"""`TaskSpec`: what a submitted task is (goal, roles, tools, limits, sandbox spec), validated on arrival.

The spec is stored verbatim in the journal, so a worker that resumes a task hours later runs it under
exactly the settings it was submitted with. Roles are configuration: a name, a system prompt, the tools
it may call and whom it may hand off to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tether.errors import ConfigError, describe_validation_error
from tether.sandbox.spec import SandboxSpec

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful software agent working in a Linux sandbox. Use the tools to act; each call's output "
    "comes back to you. When the goal is met, call `finish` with a short summary."
)


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_steps: int = Field(50, ge=1, le=100_000, description="Model calls before the task fails.")
    wall_clock_s: float = Field(3600.0, gt=0, description="Seconds since the first step before it fails.")
    max_tokens: int = Field(1_000_000, ge=1, description="Prompt plus completion tokens over all steps.")
    max_output_tokens: int = Field(512, ge=1, le=32_768, description="Completion tokens per model call.")


class RoleSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    tools: tuple[str, ...] = ("shell", "python", "write_file", "read_file", "finish")
    hands_off_to: tuple[str, ...] = ()  # roles this one may pass the task to with the `handoff` tool


MIN_CONTEXT_BUDGET_TOKENS = 256  # below this not even a system prompt, the tools and one step fit


class ContextSpec(BaseModel):
    """What each model call is shown: the newest steps verbatim, older ones folded (in blocks of
    `recent_steps`) into a digest, within `budget_tokens` (see `tether.agents.context_budget`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    recent_steps: int = Field(
        8, ge=1, description="Steps replayed verbatim into every model call, and folded at once."
    )
    budget_tokens: int = Field(
        8192,
        ge=MIN_CONTEXT_BUDGET_TOKENS,
        le=10_000_000,
        description="Most prompt tokens a model call may send; older steps are folded to stay within.",
    )
    digest_share: float = Field(
        0.3,
        gt=0,
        lt=1,
        description="Part of the budget the digest may fill; past it its oldest steps are left out.",
    )
    observation_chars: int = Field(4000, ge=100, description="Longest tool output shown to the model.")
    summary_chars: int = Field(200, ge=20, description="Characters kept per older step in the digest.")
    recall_k: int = Field(
        3, ge=0, le=50, description="Older observations recalled by embedding similarity (0: off)."
    )


class LoopSpec(BaseModel):
    """When a model repeating itself is nudged, and when it is stopped (see `tether.agents.loops`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    repeats_before_nudge: int = Field(
        3, ge=2, le=1000, description="Identical steps in a row before the model is told it repeats itself."
    )
    nudges_before_stop: int = Field(
        2, ge=0, le=1000, description="Nudges (one per further identical step) before the task fails."
    )


class SuiteCheck(BaseModel):
    """Hidden `test_*(m)` functions run through the code harness's suite mode: `imports` (e.g. `import
    ledger`) runs only in a child process holding the workdir's modules, the tests in the trusted parent."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    imports: str = Field(min_length=1, description="Python run on the candidate's side to load its modules.")
    tests: str = Field(min_length=1, description="Trusted Python defining the `test_*(m)` functions.")


class CheckSpec(BaseModel):
    """The task's success check, run in the task's workdir once the task ends: `command` (bash) passes on
    exit status 0, a last stdout line `checks: K/N` giving partial credit (K of N checks); `suite` runs
    hidden tests against the workdir's modules, one check per test. With both, every check counts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: str | None = Field(None, min_length=1, description="Bash run in the workdir when the task ends.")
    suite: SuiteCheck | None = Field(None, description="Hidden tests run against the workdir's modules.")
    timeout_s: float = Field(60.0, gt=0, le=3600, description="Seconds the check may run.")

    @model_validator(mode="after")
    def _checks_something(self) -> CheckSpec:
        if self.command is None and self.suite is None:
            raise ValueError("a check needs a `command`, a `suite` or both")
        return self


class TaskSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    goal: str = Field(min_length=1, description="What the agent must achieve, in plain language.")
    roles: tuple[RoleSpec, ...] = (RoleSpec(name="agent"),)
    limits: Limits = Field(default_factory=Limits)
    context: ContextSpec = Field(default_factory=ContextSpec)
    loop: LoopSpec = Field(default_factory=LoopSpec)
    sandbox: SandboxSpec = Field(default_factory=lambda: SandboxSpec(timeout_s=60))
    files: dict[str, str] = Field(default_factory=dict, description="Files placed in the workdir at start.")
    snapshot_every: int = Field(1, ge=1, le=1000, description="Steps between workdir checkpoints.")
    check: CheckSpec | None = Field(None, description="Run when the task ends; decides its success.")
    require_finish: bool = Field(
        False,
        description="A reply without tool calls does not end the task; only `finish` (or a budget) does.",
    )

    @model_validator(mode="after")
    def _roles_are_consistent(self) -> TaskSpec:
        names = [role.name for role in self.roles]
        if len(set(names)) != len(names):
            raise ValueError(f"roles: duplicate role names in {names}")
        for role in self.roles:
            for target in role.hands_off_to:
                if target not in names:
                    raise ValueError(
                        f"roles: {role.name!r} hands off to {target!r}, which is not a role; "
                        f"roles are {', '.join(names)}"
                    )
        return self

    def role(self, name: str) -> RoleSpec:
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(name)


def load_task_file(path: Path) -> dict[str, Any]:
    """A task template (roles, limits, context, sandbox, files) from YAML or JSON; validated by the caller."""
    if not path.is_file():
        raise ConfigError(f"task file {str(path)!r} does not exist")
    try:
        data = (
            yaml.safe_load(path.read_text())
            if path.suffix.lower() in (".yaml", ".yml")
            else json.loads(path.read_text())
        )
    except (yaml.YAMLError, json.JSONDecodeError) as error:
        raise ConfigError(
            f"task file {str(path)!r} is not valid {path.suffix[1:].upper() or 'JSON'}: {error}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"task file {str(path)!r} must hold a mapping of task fields, not {type(data).__name__}"
        )
    return data


def build_task_spec(data: dict[str, Any], source: str) -> TaskSpec:
    try:
        return TaskSpec.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, source, TaskSpec)) from None
