"""`[[rewards]]`: reward components a train config adds to environments of its mixture, each table one
component (an LLM judge or a reward model) with the environments it applies to, its weight and gate.
`rewards.py` builds them; this module only reads and checks the settings."""

from __future__ import annotations

import math
from enum import StrEnum
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from tether.chat.pricing import Price
from tether.envs.judge import check_rubric
from tether.models.precision import DEVICE_PATTERN
from tether.rl.sections import Section


class RewardKind(StrEnum):
    JUDGE = "judge"  # an LLM judge through a chat client (`tether/envs/judge.py`)
    REWARD_MODEL = "reward_model"  # a sequence classifier (`tether/models/classifier.py`)


# The settings only one kind reads (the rest are shared).
_JUDGE_ONLY = (
    "model",
    "base_url",
    "api_key_env",
    "rubric",
    "labels",
    "max_tokens",
    "max_reason_chars",
    "concurrency",
    "price",
)
_REWARD_MODEL_ONLY = ("path", "max_batch", "logit_shift", "logit_scale", "positive_label")


class RewardSection(Section):
    """One `[[rewards]]` table: a component appended to the rubric of every mixture environment that
    `envs` matches. Its value enters the weighted mean with `weight`; with `gate`, it multiplies the total."""

    kind: RewardKind = Field(description="judge (an LLM judge) or reward_model (a sequence classifier).")
    name: str | None = Field(
        None,
        pattern=r"^[a-z][a-z0-9_]*$",
        description="Component name in metrics (reward/<name>); unset: the kind (judge, reward_model).",
    )
    envs: str = Field(
        "*",
        min_length=1,
        description="Comma-separated globs over the mixture's environment names that get the component.",
    )
    weight: float = Field(1.0, ge=0, allow_inf_nan=False, description="Weight in the rubric's mean.")
    gate: bool = Field(False, description="Multiply the environment's total by the component's value.")
    device: str = Field(
        "auto",
        pattern=DEVICE_PATTERN,
        description="Torch device of the reward model, or of a judge on our engine in this process.",
    )
    model: str | None = Field(
        None,
        min_length=1,
        description="judge: what to ask: with base_url, the model name the server serves; without, a "
        "registered model or model folder run on our engine in this process, or scripted:FILE "
        "(replies replayed, for tests).",
    )
    base_url: str | None = Field(
        None,
        pattern=r"^https?://[^\s?#]+$",
        description="judge: an OpenAI-compatible endpoint, up to where /chat/completions is appended "
        "(http://host:8000/v1); unset: the engine in this process (or scripted:FILE).",
    )
    api_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="judge with base_url: the environment variable holding its API key (never the key).",
    )
    rubric: str | None = Field(
        None,
        description="judge: the prompt template, with {prompt} (the task's question), {reference} (its "
        "reference answer, '(none)' if empty) and {answer}; literal braces doubled. Unset: "
        "tether.envs.judge.DEFAULT_RUBRIC.",
    )
    labels: dict[str, float] | None = Field(
        None,
        description="judge: verdict labels and their scores in [0, 1] (e.g. correct = 1.0, partial = 0.5, "
        "wrong = 0.0); unset: the verdict's score is a number in [0, 1].",
    )
    max_tokens: int = Field(256, ge=1, description="judge: the longest verdict, tokens.")
    max_reason_chars: int = Field(
        1000,
        ge=1,
        description="judge: the verdict's reason is at most this many characters (the schema's maxLength, "
        "which a judge held to the schema's grammar, as our engine is, stops at).",
    )
    concurrency: int = Field(16, ge=1, description="judge: requests in flight at once.")
    price: Price | None = Field(
        None,
        description="judge: USD per million tokens (input_cache_hit_per_mtok, input_cache_miss_per_mtok, "
        "output_per_mtok) for judge/cost_usd; unset: the gateway's standard tier.",
    )
    path: Path | None = Field(
        None,
        description="reward_model: a local folder holding a *ForSequenceClassification checkpoint "
        "(config.json, safetensors, tokenizer with a chat template); nothing is downloaded.",
    )
    max_batch: int = Field(16, ge=1, description="reward_model: conversations scored in one forward.")
    logit_shift: float = Field(
        0.0,
        allow_inf_nan=False,
        description="reward_model, one label: score = sigmoid((logit - shift) / scale).",
    )
    logit_scale: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="reward_model, one label: see logit_shift."
    )
    positive_label: int | None = Field(
        None,
        ge=0,
        description="reward_model, several labels: the label whose softmax probability is the score "
        "(unset: the last).",
    )

    @property
    def component(self) -> str:
        """The component's name in the rubric and in metrics."""
        return self.name or self.kind.value

    @field_validator("rubric")
    @classmethod
    def _rubric(cls, rubric: str | None) -> str | None:
        return None if rubric is None else check_rubric(rubric)

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, float] | None) -> dict[str, float] | None:
        if labels is not None:
            bad = {k: v for k, v in labels.items() if not (math.isfinite(v) and 0 <= v <= 1)}
            if not labels or bad:
                raise ValueError(f"rewards.labels {bad or labels}: name labels, each scored in [0, 1]")
        return labels

    @model_validator(mode="after")
    def _kind_settings(self) -> RewardSection:
        defaults = {
            key: field.get_default(call_default_factory=True)
            for key, field in type(self).model_fields.items()
        }
        other = _REWARD_MODEL_ONLY if self.kind is RewardKind.JUDGE else _JUDGE_ONLY
        given = [key for key in other if getattr(self, key) != defaults[key]]
        if given:
            raise ValueError(
                f"rewards ({self.component}): {', '.join(given)} is not read by kind = {str(self.kind)!r}"
            )
        if self.kind is RewardKind.JUDGE:
            if self.model is None and self.base_url is None:
                raise ValueError(
                    f"rewards ({self.component}): a judge needs model (a model run in this process, or "
                    "scripted:FILE) or base_url (an OpenAI-compatible server)"
                )
            if self.api_key_env is not None and self.base_url is None:
                raise ValueError(f"rewards ({self.component}): api_key_env is read only with base_url")
        elif self.path is None:
            raise ValueError(
                f"rewards ({self.component}): a reward model needs path, a local folder holding a "
                "*ForSequenceClassification checkpoint"
            )
        return self
