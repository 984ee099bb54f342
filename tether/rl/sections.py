"""The sections of a train config (`[model]`, `[envs]`, `[rollout]`, `[algorithm]`, `[optim]`, `[run]`,
`[agents]`; `[ray]` and `[learner]` in `cluster_sections.py`, the `[[rewards]]` tables in
`reward_sections.py`, `[cost]` and `[monitors]` in `report_sections.py`) and the kinds their fields take;
`config.py` composes them into `TrainConfig`. Each section validates its own fields; checks across
sections live in `TrainConfig`."""

from __future__ import annotations

import math
import re
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tether.models.config import RopeScaling, UnsupportedModelError
from tether.models.precision import DEVICE_PATTERN, DType
from tether.rl.advantages import AdvantageKind
from tether.rl.losses import Aggregation, Correction, LossConfig


class Mode(StrEnum):
    SYNC = "sync"  # generate, then learn on that batch: strictly on-policy
    ASYNC = "async"  # generate the next batch while learning on this one, within max_staleness


class Backend(StrEnum):
    LOCAL = "local"  # the learner in this process
    RAY = "ray"  # the learner as a Ray actor (`ray_backend.py`)


class RolloutBackend(StrEnum):
    LOCAL = "local"  # our engine in the learner's process
    RAY = "ray"  # our engines as Ray actors, one per rollout worker (`ray_backend.py`)
    VLLM = "vllm"  # a fleet of vLLM servers (`servers.py`)
    SGLANG = "sglang"  # a fleet of SGLang servers

    @property
    def remote(self) -> bool:
        """Whether rollouts come from servers over HTTP rather than from our engine."""
        return self in (RolloutBackend.VLLM, RolloutBackend.SGLANG)


class WeightSync(StrEnum):
    """How a new version's weights reach rollout engines that live outside the learner's process."""

    AUTO = "auto"  # the backend's best: collective for Ray engines and SGLang, safetensors for vLLM
    COLLECTIVE = "collective"  # a torch.distributed broadcast (gloo on CPU, NCCL on CUDA)
    OBJECT_STORE = "object_store"  # ray: one copy in Ray's object store, every worker pulls it
    SAFETENSORS = "safetensors"  # vllm/sglang: a safetensors folder per version the servers load


# The weight_sync values each rollout backend accepts (AUTO first, then what it resolves to).
WEIGHT_SYNCS: dict[RolloutBackend, tuple[WeightSync, ...]] = {
    RolloutBackend.LOCAL: (WeightSync.AUTO,),  # the engine shares the learner's process: nothing travels
    RolloutBackend.RAY: (WeightSync.AUTO, WeightSync.COLLECTIVE, WeightSync.OBJECT_STORE),
    # vLLM's weight-transfer engine speaks NCCL through its own communicator, not a torch group:
    # not implemented (server_weights.py says why), so its servers load safetensors folders.
    RolloutBackend.VLLM: (WeightSync.AUTO, WeightSync.SAFETENSORS),
    RolloutBackend.SGLANG: (WeightSync.AUTO, WeightSync.COLLECTIVE, WeightSync.SAFETENSORS),
}
AUTO_SYNC = {
    RolloutBackend.LOCAL: WeightSync.AUTO,
    RolloutBackend.RAY: WeightSync.COLLECTIVE,
    RolloutBackend.VLLM: WeightSync.SAFETENSORS,
    RolloutBackend.SGLANG: WeightSync.COLLECTIVE,
}


# A rollout server's root: http(s)://host[:port], no path (the clients add /v1/... or /generate).
URL_PATTERN = r"^https?://[^/\s?#]+/?$"


class Schedule(StrEnum):
    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSection(Section):
    """`[model.lora]`: train low-rank adapters (peft) instead of every weight; unset: full fine-tuning."""

    r: int = Field(16, ge=1, le=1024, description="Adapter rank.")
    alpha: float = Field(32.0, gt=0, description="Scaling numerator: the update is (alpha / r) * B @ A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input while training.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(PROJECTIONS),
        min_length=1,
        description=f"Projections that get adapters, some of: {', '.join(PROJECTIONS)}.",
    )

    @field_validator("target_modules")
    @classmethod
    def _known(cls, modules: list[str]) -> list[str]:
        unknown = sorted(set(modules) - set(PROJECTIONS))
        if unknown:
            raise ValueError(
                f"model.lora.target_modules {unknown}: expected some of {', '.join(PROJECTIONS)}"
            )
        if len(set(modules)) != len(modules):
            raise ValueError(f"model.lora.target_modules {modules}: name each projection once")
        return modules


class ModelSection(Section):
    name: str = Field("smollm2-135m-instruct", description="Registered model name or a local HF folder.")
    cache_dir: Path | None = Field(None, description="Model cache (default: the tether settings' cache).")
    device: str = Field(
        "auto",
        pattern=DEVICE_PATTERN,
        description="Torch device of learner and engine: auto (CUDA where present), cpu, cuda, cuda:N.",
    )
    dtype: DType = Field(
        DType.FLOAT32,
        description="Engine weights and KV cache, and the learner's compute: float32, bfloat16, float16 "
        "(the learner keeps float32 master weights).",
    )
    kv_cache_mib: int = Field(256, ge=1, description="Engine KV cache size, MiB.")
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="Longest sequence (prompt and output) the engine holds, in tokens, checked against the "
        "model's context (with rope_scaling) and kv_cache_mib; unset: the least of the model's context, "
        "4096 and what the KV cache holds.",
    )
    rope_scaling: str | None = Field(
        None,
        description="Rope scaling the engine and the learner run the model with instead of its config's: "
        'TYPE:FACTOR ("yarn:4", "linear:2", "dynamic:2") or a JSON object as in a config.json.',
    )
    lora: LoraSection | None = Field(
        None, description="LoRA adapters ([model.lora]); unset: full fine-tuning."
    )
    strict_matmul: bool = Field(
        True,
        description="CPU: MKL's strict reproducible mode (MKL_CBWR=AUTO,STRICT), so a matmul row does not "
        "depend on the thread split and the learner recomputes the engine's logprobs exactly; it must "
        "be on before the process's first matmul. Off: a little faster, logprob gaps of ~3e-5.",
    )

    @field_validator("rope_scaling")
    @classmethod
    def _rope_parses(cls, text: str | None) -> str | None:
        if text is not None:
            try:
                RopeScaling.parse(text)
            except UnsupportedModelError as error:
                raise ValueError(f"model.rope_scaling = {text!r}: {error}") from None
        return text

    def rope(self) -> RopeScaling | None:
        """`rope_scaling` parsed (checked on construction)."""
        return None if self.rope_scaling is None else RopeScaling.parse(self.rope_scaling)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and "bf16" in raw:
            value = raw["bf16"]
            hint = 'dtype = "bfloat16"' if value is True else 'dtype = "float32" (the default)'
            raise ValueError(f"model.bf16 = {value!r} was replaced by model.dtype: write {hint}")
        return raw


class VerifiersEnvSection(Section):
    """A `verifiers` environment (PyPI `verifiers`, e.g. an Environments Hub package) trained as `vf/NAME`."""

    module: str = Field(
        min_length=1, description="Module with load_environment(**args), e.g. 'vf_gsm8k' ('-' read as '_')."
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of load_environment.")
    max_turns: int = Field(
        10, ge=1, description="Turn limit of a MultiTurnEnv whose own max_turns is unlimited (-1)."
    )
    reward_range: tuple[float, float] = Field(
        (0.0, 1.0),
        description="What its reward functions return, mapped linearly to [0, 1]; values outside are "
        "invalid rewards, never clipped.",
    )

    @field_validator("reward_range")
    @classmethod
    def _ordered(cls, bounds: tuple[float, float]) -> tuple[float, float]:
        low, high = bounds
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"reward_range {list(bounds)}: expected two finite numbers, low < high")
        return bounds


class EnvsSection(Section):
    weights: dict[str, float] = Field(
        min_length=1, description="Environment name or glob -> sampling weight (see `tether envs list`)."
    )
    verifiers: dict[str, VerifiersEnvSection] = Field(
        default_factory=dict,
        description="`verifiers` environments registered as `vf/<key>` (the `tether[verifiers]` extra).",
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

    @field_validator("verifiers")
    @classmethod
    def _names(cls, envs: dict[str, VerifiersEnvSection]) -> dict[str, VerifiersEnvSection]:
        bad = [key for key in envs if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-+]*", key)]
        if bad:
            raise ValueError(
                f"envs.verifiers {bad}: a name is letters, digits and '_.-+' (it becomes vf/NAME)"
            )
        return envs


_REMOTE = (
    "base_urls",
    "served_model",
    "timeout_s",
    "weights_dir",
    "api_key_env",
    "sync_host",
    "health_timeout_s",
    "server_attempts",
    "server_probe_s",
)  # the settings only servers read


class RolloutSection(Section):
    prompts_per_step: int = Field(8, ge=1, description="Prompts (groups) drawn from the mixture per step.")
    samples_per_prompt: int = Field(4, ge=1, le=256, description="n: completions per prompt (group size).")
    max_new_tokens: int = Field(64, ge=1, description="Longest completion, tokens.")
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature (> 0 for RL).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling; logprobs stay untruncated.")
    backend: RolloutBackend | None = Field(
        None,
        description="Where rollouts come from: local (our engine in the learner's process), ray (our "
        "engines as Ray actors, see [ray]), vllm or sglang (the servers at base_urls); unset: "
        "as run.backend.",
    )
    base_urls: list[str] = Field(
        default_factory=list,
        description="vllm/sglang: the servers' roots, http(s)://host:port (no /v1); a step's prompts are "
        "spread over them.",
    )
    served_model: str | None = Field(
        None, description="vllm/sglang: the model name requests carry (unset: model.name)."
    )
    timeout_s: float = Field(
        600.0,
        gt=0,
        allow_inf_nan=False,
        description="vllm/sglang: longest wait for one server answer, a whole completion included, s.",
    )
    health_timeout_s: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        description="vllm/sglang: longest wait for a server's health check (GET /health), s; a server "
        "that fails one, or a request (refused, reset, timed out, 5xx) or a weight update, leaves the "
        "rotation and its prompts go to the others.",
    )
    server_attempts: int = Field(
        3,
        ge=1,
        le=100,
        description="vllm/sglang: most times one prompt is sent (the same seeds each time, on another "
        "server after one failed it); then its samples come back infra-failed (engine_failure).",
    )
    server_probe_s: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="vllm/sglang: wait before a removed server is probed again at a step's start, s, "
        "doubled after each failed probe (at most 10 minutes); it rejoins once it has loaded the "
        "current weights.",
    )
    weights_dir: Path | None = Field(
        None,
        description="vllm/sglang: where each version's safetensors go for the servers to load (a path they "
        "see the same way); only the version they hold is kept. Unset: <run dir>/weights.",
    )
    api_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="vllm/sglang: the environment variable holding the servers' API key (sent as a "
        "bearer token; the key itself never enters config.toml). Unset: no key.",
    )
    weight_sync: WeightSync = Field(
        WeightSync.AUTO,
        description="How each version's weights reach the engines: ray accepts collective (default) or "
        "object_store, sglang collective (default) or safetensors, vllm safetensors; auto: the default.",
    )
    infra_retries: int = Field(
        2,
        ge=0,
        le=10,
        description="Times a rollout that failed for an infrastructure reason (sandbox error or failed "
        "worker QC, scorer error or timeout, invalid reward) is tried again: a single-turn answer is "
        "re-scored, an episode or agent task re-run with the same seeds. Still failed, it is left out "
        "of its group's advantages.",
    )
    score_timeout_s: float = Field(
        600.0,
        gt=0,
        allow_inf_nan=False,
        description="Longest one scoring (an answer's reward, an episode's final score) may take before "
        "it counts as a scorer_timeout infrastructure failure, s.",
    )
    max_infra_failure_rate: float = Field(
        0.5,
        ge=0,
        le=1,
        description="A step whose share of rollouts still infra-failed after retries is above this "
        "stops the run (InfraFailureRateError) before learning from it; 1: never stop.",
    )
    sync_host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="sglang with weight_sync collective: this process's address as the servers reach it "
        "(they join the broadcast group there, on a free port).",
    )

    @field_validator("base_urls")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        bad = [url for url in urls if not re.match(URL_PATTERN, url)]
        if bad:
            raise ValueError(f"rollout.base_urls {bad}: expected http(s)://host[:port] roots (no path)")
        if len(set(urls)) != len(urls):
            raise ValueError(f"rollout.base_urls {urls}: name each server once")
        return urls

    @model_validator(mode="after")
    def _remote_settings(self) -> RolloutSection:
        remote = self.backend is not None and self.backend.remote
        if remote and not self.base_urls:
            raise ValueError(
                f"rollout.backend = {str(self.backend)!r} needs rollout.base_urls, the servers to generate "
                'with, e.g. base_urls = ["http://localhost:8000"]'
            )
        # By value, not by presence: the run directory's config.toml spells out every default.
        defaults = {
            key: RolloutSection.model_fields[key].get_default(call_default_factory=True) for key in _REMOTE
        }
        given = [key for key in _REMOTE if getattr(self, key) != defaults[key]]
        if given and not remote:
            chosen = f"not {str(self.backend)!r}" if self.backend else "which is unset (as run.backend)"
            raise ValueError(
                f"rollout.{given[0]} is read only with rollout.backend = 'vllm' or 'sglang', {chosen}"
            )
        return self


class AlgorithmSection(Section):
    advantage: AdvantageKind = Field(AdvantageKind.GRPO, description="grpo, dr_grpo or rloo.")
    aggregation: Aggregation = Field(
        Aggregation.SEQUENCE_MEAN, description="sequence_mean (GRPO), token_mean (DAPO), sequence_sum (Dr.)"
    )
    clip_low: float = Field(0.2, ge=0, lt=1, description="Ratio clipped below at 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0, le=10, description="Ratio clipped above at 1 + clip_high.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of k3 KL to the frozen initial model (0: none).")
    drop_equal_groups: bool = Field(False, description="DAPO dynamic sampling: skip all-equal groups.")
    min_group_samples: int = Field(
        2,
        ge=1,
        description="Fewest scored samples a group keeps after leaving out infra-failed ones; a group "
        "with fewer is dropped (capped at rollout.samples_per_prompt).",
    )
    overlong_buffer_tokens: int = Field(
        0, ge=0, description="DAPO overlong penalty over the last N tokens of max_new_tokens (0: off)."
    )
    tis_cap: float = Field(
        2.0,
        ge=1,
        allow_inf_nan=False,
        description="Truncated importance sampling: stale samples' gradients are weighted by "
        "min(ratio to the behaviour policy, tis_cap).",
    )
    mismatch_correction: Correction = Field(
        Correction.NONE,
        description="Trainer-engine mismatch correction (bf16, other kernels): none; token (each token's "
        "gradient weighted by min(its ratio learner / engine, mismatch_cap)); sequence (every token by "
        "min(the product of its sequence's ratios, mismatch_cap)). Applies to every sample, stale ones "
        "included (tis_cap is then not read); learner/mismatch_weight_mean and tis_truncated report it.",
    )
    mismatch_cap: float = Field(
        2.0, ge=1, allow_inf_nan=False, description="The largest mismatch_correction weight (truncation)."
    )

    def loss(self) -> LossConfig:
        return LossConfig(self.clip_low, self.clip_high, self.aggregation, self.kl_coef)


class OptimSection(Section):
    lr: float = Field(1e-6, gt=0, le=1, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    max_grad_norm: float = Field(1.0, gt=0, description="Gradients clipped to this global L2 norm.")
    micro_batch: int = Field(
        8, ge=1, description="Sequences per forward/backward; the step accumulates over the batch."
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="Most tokens per forward/backward as well (each prompt counted once, then its "
        "completions); a single sample longer than this runs alone. Unset: micro_batch alone bounds it.",
    )
    schedule: Schedule = Field(Schedule.CONSTANT, description="LR after warm-up: constant, linear, cosine.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up from 0 to lr, steps.")


class RunSection(Section):
    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$", description="Run directory name.")
    out_dir: Path = Field(Path("runs"), description="Runs are written to out_dir/name.")
    steps: int = Field(100, ge=1, description="Training steps (one optimizer update each).")
    seed: int = Field(0, ge=0, description="Seeds task choice, sampling and torch.")
    mode: Mode = Field(Mode.SYNC, description="sync (on-policy) or async (bounded staleness).")
    max_staleness: int = Field(1, ge=0, description="async: most policy versions a rollout may lag.")
    backend: Backend = Field(
        Backend.LOCAL,
        description="Where the learner runs: local (this process) or ray (an actor, see [ray]); also where "
        "rollouts come from unless rollout.backend says otherwise.",
    )
    checkpoint_every: int = Field(10, ge=1, description="Checkpoint every N steps (and at the end/SIGTERM).")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk (oldest removed).")
    transcripts_per_step: int = Field(2, ge=0, description="Sampled transcripts written per step.")
    adapt_threads: bool = Field(
        True,
        description="Follow the cores free while training (tether.models.governor): a torch thread fewer "
        "when ours wait for a CPU, one more when a core stands idle; recorded as run/threads. False: the "
        "count at the start holds (results then never depend on a changing split of the matmuls).",
    )
    threads_window_s: float = Field(
        2.0, gt=0, description="adapt_threads: seconds of load seen before each re-decision, at least."
    )


class AgentJournal(StrEnum):
    MEMORY = "memory"
    RUN = "run"


class AgentsSection(Section):
    """Agent task families in the mixture (`envs.weights`: `agent/shell`, `agent/ledger`, ...)."""

    max_steps: int = Field(
        8, ge=1, le=1000, description="Model calls per agent-task episode (the task's step budget)."
    )
    journal: AgentJournal = Field(
        AgentJournal.MEMORY,
        description="memory: each batch's episodes journaled in a temporary SQLite journal; run: in "
        "<run dir>/agent_journal, kept, so a rollout killed mid-batch resumes with --resume and no "
        "step is applied twice.",
    )
