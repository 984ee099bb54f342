"""A new task as the console's form (or `POST /api/agents`) asks for it: a goal with a role team and a step
budget, or a family's seeded task, the choices `tether agent submit` and `run --family` offer. Blank form
fields count as not given; the spec is built by the CLI's own functions."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tether.agents.submission import family_task, goal_spec
from tether.agents.task import TaskSpec


class TaskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)

    goal: str | None = Field(None, max_length=20_000, description="What the agent should achieve.")
    family: str | None = Field(None, max_length=128, description="Or a task of this family (agent/shell).")
    seed: int = Field(0, ge=0, description="With a family: which of its tasks.")
    max_steps: int | None = Field(None, ge=1, le=100_000, description="Step budget of the task.")
    roles: str | None = Field(None, max_length=256, description="Role team, e.g. planner,coder,reviewer.")
    require_finish: bool = Field(True, description="Only `finish` ends the task (a chatty reply is nudged).")

    @field_validator("*", mode="before")
    @classmethod
    def _blank_is_not_given(cls, value: Any) -> Any:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("seed", "require_finish", mode="before")
    @classmethod
    def _default_when_blank(cls, value: Any, info: Any) -> Any:
        return cls.model_fields[info.field_name].default if value is None else value

    @model_validator(mode="after")
    def _one_kind_of_task(self) -> TaskRequest:
        if (self.goal is None) == (self.family is None):
            raise ValueError("give a goal, or a family (with a seed) for a task of that family, not both")
        if self.family is not None and self.roles is not None:
            raise ValueError(f"family {self.family} sets the whole task: leave roles empty")
        return self

    def spec(self) -> TaskSpec:
        """The task's spec; an unknown family or role is a `ConfigError` naming it and the known ones."""
        if self.family is not None:
            return family_task(self.family, self.seed, self.max_steps)
        assert self.goal is not None
        return goal_spec(self.goal, self.roles, self.max_steps, self.require_finish)
