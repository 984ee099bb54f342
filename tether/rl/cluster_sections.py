"""The sections of a train config that say where a run's processes go: `[ray]`, the actors of the Ray
backend and what each reserves, and `[learner]`, how the learner is laid out over ranks."""

from __future__ import annotations

from pydantic import Field

from tether.models.memory_plan import Strategy
from tether.rl.sections import Section


class RaySection(Section):
    """Ray backend only: the actors of a run and the resources each asks for (one placement group)."""

    address: str | None = Field(
        None, description="Ray cluster to join ('auto', 'ray://host:port'); unset: start one in process."
    )
    rollout_workers: int = Field(1, ge=1, description="Rollout workers, each with its own engine.")
    learner_cpus: float = Field(1.0, gt=0, description="CPUs reserved for each learner actor (one per rank).")
    rollout_cpus: float = Field(1.0, gt=0, description="CPUs reserved for each rollout worker.")
    learner_gpus: float = Field(0.0, ge=0, description="GPUs reserved for each learner actor (> 0 on cuda).")
    rollout_gpus: float = Field(0.0, ge=0, description="GPUs reserved per rollout worker (> 0 on cuda).")
    object_store_mib: int = Field(
        512, ge=64, description="Object store of a cluster started in process (weights travel there), MiB."
    )
    placement_timeout_s: float = Field(
        60.0, gt=0, description="How long to wait for the cluster to fit the actors before failing, s."
    )
    call_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Longest wait for any call to an actor (a worker's generate, a learner step, a weight "
        "load), s: an actor that has not answered by then is killed as lost (a worker is replaced, a "
        "learner resumed from the last checkpoint) and named in the error.",
    )
    max_worker_restarts: int = Field(
        3,
        ge=0,
        description="Rollout workers replaced after dying or hanging (their prompts are issued again "
        "with the same seeds), per run and again after a learner resumption; one more loss stops the "
        "run naming the worker.",
    )
    max_learner_restarts: int = Field(
        2,
        ge=0,
        description="Times a run whose learner actor died or hung resumes from its last checkpoint on new "
        "actors (run/resumptions counts them); one more loss stops the run.",
    )


class LearnerSection(Section):
    """`[learner]`: how the learner is laid out over processes (`sharded.py`, `distributed.py`)."""

    strategy: Strategy = Field(
        Strategy.SINGLE, description="single (one process) or fsdp (FSDP2 over world_size ranks)."
    )
    world_size: int = Field(
        1,
        ge=1,
        description="Learner ranks; > 1 needs fsdp. Under torchrun it must equal WORLD_SIZE; "
        "with run.backend = 'ray', one learner actor each.",
    )
    activation_checkpointing: bool = Field(
        False, description="fsdp: recompute each layer's MLP activations in backward instead of keeping them."
    )
    reshard_after_forward: bool = Field(
        True, description="fsdp: free gathered layer weights after forward (gather again in backward)."
    )
    prefetch: int = Field(
        1, ge=0, le=4, description="fsdp: layers whose all-gathers are issued ahead of compute (0: none)."
    )
    context_parallel: int = Field(
        1,
        ge=1,
        description="fsdp: ranks that split each micro-batch's token row between them, attention by ring "
        "exchange of K/V blocks (`context_parallel.py`); groups of consecutive ranks, world_size / "
        "context_parallel of them training on different prompt groups. 1: off.",
    )
    async_checkpoint: bool = Field(
        False, description="Write checkpoints in the background (torch.distributed.checkpoint.async_save)."
    )
    timeout_s: float = Field(
        600.0,
        gt=0,
        description="fsdp: a collective waiting longer than this fails the run instead of hanging.",
    )
