"""How far the sharded learner is from the single-process one, measured: the same batches through both.

`compare_with_single` trains a model for a few steps on seeded synthetic batches (on-policy: behaviour
logprobs are the single learner's own), once in this process and once as an FSDP2 learner over
`world_size` ranks it spawns (gloo, this machine), and reports the largest gap in losses and in final
weights, and the per-rank bytes of parameters and optimizer state. It is what the tests assert on and
what `tether rl bench-sync` reports; it starts no rollout engine and writes no run directory.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.spawn import start_processes

from tether.models import load
from tether.models.dense import DenseBatch, token_logprobs
from tether.models.memory_plan import Strategy
from tether.models.transformer import CausalLM
from tether.rl.cluster_sections import LearnerSection
from tether.rl.distributed import LearnerGroup, Rendezvous, local_init_method
from tether.rl.learner import Learner
from tether.rl.losses import LossConfig
from tether.rl.samples import Sample
from tether.rl.sections import OptimSection
from tether.rl.sharded import ShardedLearner, local_state_bytes

_TIMEOUT_S = 600.0


def _batch(model: CausalLM, vocab: int, prompts: int, group: int, seed: int) -> list[Sample]:
    """`prompts` groups of `group` samples of random tokens, scored on-policy by `model`."""
    generator = torch.Generator().manual_seed(seed)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=generator))

    shapes = []
    for _ in range(prompts):
        prompt = torch.randint(0, vocab, (draw(3, 8),), generator=generator).tolist()
        for _ in range(group):
            completion = torch.randint(0, vocab, (draw(2, 7),), generator=generator).tolist()
            shapes.append((prompt, completion, float(torch.rand((), generator=generator)) * 2 - 1))
    with torch.no_grad():
        behaviour = token_logprobs(
            model,
            DenseBatch.padded([p + c for p, c, _ in shapes]),
            [(len(p), len(p) + len(c)) for p, c, _ in shapes],
        )
    return [
        Sample(p + c, len(p), lp.tolist(), advantage)
        for (p, c, advantage), lp in zip(shapes, behaviour, strict=True)
    ]


def _learner_options(optim: OptimSection, steps: int) -> dict[str, Any]:
    return {
        "optim": optim,
        "loss": LossConfig(),
        "total_steps": steps,
        "temperature": 1.0,
        "max_new_tokens": 8,
    }


def _sharded_rank(
    rank: int,
    world_size: int,
    init_method: str,
    model: str,
    cache_dir: Path | None,
    options: dict[str, Any],
    section: LearnerSection,
    batches: list[list[Sample]],
    out: Path,
) -> None:
    torch.set_num_threads(1)
    group = LearnerGroup(Rendezvous(rank, world_size, init_method), "cpu", _TIMEOUT_S)
    learner = ShardedLearner(load(model, cache_dir)[0], group, section, **options)
    if rank > 0:
        learner.follow()
        group.close()
        return
    try:
        start = time.perf_counter()
        stats = [learner.step(batch).to_dict() for batch in batches]
        seconds = (time.perf_counter() - start) / len(batches)
        weights = {name: tensor.clone() for name, tensor in learner.weights()}
        torch.save(
            {"stats": stats, "weights": weights, "bytes": local_state_bytes(learner), "step_s": seconds},
            out,
        )
    finally:
        learner.close()


def compare_with_single(
    model: str | Path,
    steps: int = 3,
    world_size: int = 2,
    cache_dir: Path | None = None,
    optim: OptimSection | None = None,
    prompts: int = 4,
    samples_per_prompt: int = 2,
    learner: LearnerSection | None = None,
    seed: int = 0,
    options: Mapping[str, Any] | None = None,
    batches: Sequence[list[Sample]] | None = None,
    start_method: str = "spawn",
) -> dict[str, float]:
    """Train `model` (a registered name or HF folder) `steps` steps single and as `world_size` FSDP2
    ranks on the same batches; returns the largest |difference| of losses and of final weights, the
    per-rank parameter + optimizer bytes of each (rank 0's shard is FSDP's largest) and their ratio,
    and the mean step time of each (on this machine the ranks share its cores). `options`: more
    arguments of both learners (e.g. `compute_dtype`); `batches`: what to train on instead of the
    seeded on-policy ones, a step each (`steps` is then their number); `start_method`: how the ranks
    start ("fork" skips re-importing torch and tether in each, where this process may fork)."""
    optim = optim or OptimSection(lr=1e-6, micro_batch=2)
    section = learner or LearnerSection(strategy=Strategy.FSDP, world_size=world_size)
    steps = len(batches) if batches is not None else steps
    learner_options = {**_learner_options(optim, steps), **(options or {})}
    single = Learner(load(str(model), cache_dir)[0], **learner_options)
    vocab = single.model.config.vocab_size
    trained: list[list[Sample]] = []  # the batches both learners step on
    stats = []
    started = time.perf_counter()
    for step in range(steps):
        batch = (
            batches[step]
            if batches is not None
            else _batch(single.model, vocab, prompts, samples_per_prompt, seed + step)
        )
        trained.append(batch)
        stats.append(single.step(batch).to_dict())
    single_s = (time.perf_counter() - started) / steps
    with tempfile.TemporaryDirectory(prefix="tether-parity-") as tmp:
        out = Path(tmp) / "sharded.pt"
        start_processes(  # type: ignore[no-untyped-call]
            _sharded_rank,
            args=(
                world_size,
                local_init_method(),
                str(model),
                cache_dir,
                learner_options,
                section,
                trained,
                out,
            ),
            nprocs=world_size,
            start_method=start_method,
        )
        sharded = torch.load(out)
    weights = dict(single.model.named_parameters())
    weight_gap = max(float((sharded["weights"][n] - p.detach()).abs().max()) for n, p in weights.items())
    single_bytes = local_state_bytes(single)
    return {
        "fsdp2_max_abs_diff_vs_single": weight_gap,
        "fsdp2_max_loss_diff_vs_single": max(
            abs(a["learner/loss"] - b["learner/loss"]) for a, b in zip(stats, sharded["stats"], strict=True)
        ),
        # every learner/* statistic (ratios, logprob gap, IS weights): the ranks' reductions are exact;
        # the phases' seconds (`time/*`) are timings, not statistics
        "fsdp2_max_stat_diff_vs_single": max(
            abs(a[key] - b[key])
            for a, b in zip(stats, sharded["stats"], strict=True)
            for key in a
            if not key.startswith("time/")
        ),
        f"rank_memory_ratio_{world_size}_vs_1": sharded["bytes"] / single_bytes,
        "rank_bytes_single": float(single_bytes),
        f"rank_bytes_{world_size}": float(sharded["bytes"]),
        "step_s_single": single_s,
        f"step_s_{world_size}_ranks": sharded["step_s"],
    }
