"""The Ray backend's pure planning: the placement group's bundles, and a step's prompts sharded over the
rollout workers and merged back in plan order. No Ray, no model: plain data in, plain data out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tether.rl.cluster_sections import RaySection
from tether.rl.rollout import PromptPlan
from tether.rl.sources import Generated
from tether.scheduler.ray_backend import PlacementGroupPlan


def plan_bundles(name: str, ray: RaySection, learners: int = 1, workers: bool = True) -> PlacementGroupPlan:
    """Bundles 0..learners-1 for the learner actors (one per rank of a sharded learner; none when the
    learner is not an actor), then one per rollout worker (if they are actors); PACK keeps them on as
    few nodes as fit."""

    def bundle(cpus: float, gpus: float) -> dict[str, float]:
        return {"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}

    bundles = [bundle(ray.learner_cpus, ray.learner_gpus)] * learners
    bundles += [
        bundle(ray.rollout_cpus, ray.rollout_gpus) for _ in range(ray.rollout_workers if workers else 0)
    ]
    return PlacementGroupPlan(name=f"tether-{name}", bundles=tuple(bundles), strategy="PACK")


def shard_plans(plans: Sequence[PromptPlan], workers: int) -> list[list[PromptPlan]]:
    """Contiguous, near-equal shards, one per worker (possibly empty), each renumbered from group 0.

    A worker's rollouts name their prompt by its index in the worker's shard (`score_groups` looks the
    task up by it); `merge_shards` maps them back. Sampling seeds stay with their plan."""
    assert workers >= 1
    size, extra = divmod(len(plans), workers)
    shards, start = [], 0
    for index in range(workers):
        end = start + size + (index < extra)
        shards.append([replace(plan, group=local) for local, plan in enumerate(plans[start:end])])
        start = end
    return shards


def merge_shards(plans: Sequence[PromptPlan], outputs: Sequence[Generated]) -> Generated:
    """The workers' outputs (in shard order) as one `Generated` in plan order, their rollouts' groups
    renumbered in place; the timings are the slowest worker's (they run in parallel), the counters summed."""
    tasks, rollouts, offset = [], [], 0
    counters: dict[str, float] = {}
    for out in outputs:
        for name, value in out.counters.items():
            counters[name] = counters.get(name, 0.0) + value
        tasks.extend(out.tasks)
        for rollout in out.rollouts:
            rollout.group = plans[offset + rollout.group].group
            rollouts.append(rollout)
        offset += len(out.tasks)
    assert offset == len(plans), f"workers returned {offset} prompts for {len(plans)} planned"
    return Generated(
        tasks,
        rollouts,
        max((out.generate_s for out in outputs), default=0.0),
        max((out.score_s for out in outputs), default=0.0),
        counters,
    )
