"""Step metrics from rollouts: overall and per domain (reward, each component, pass rate, lengths...).

Pure functions over plain data; the trainer adds timings and learner statistics and writes the dict as one
line of `metrics.jsonl`. Keys are flat (`domain/<env>/reward`) so that any log viewer can plot them.
"""

from __future__ import annotations

from collections.abc import Sequence

from tether.rl.rollout import Rollout


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def rollout_metrics(rollouts: Sequence[Rollout], prefix: str = "") -> dict[str, float]:
    """Reward, components, pass rate, response length, truncation, sandbox time and errors of a set."""
    out = {
        f"{prefix}reward": _mean([r.reward for r in rollouts]),
        f"{prefix}pass_rate": _mean([float(r.passed) for r in rollouts]),
        f"{prefix}response_tokens": _mean([float(r.generated_tokens) for r in rollouts]),
        f"{prefix}turns": _mean([float(max(len(r.turns), 1)) for r in rollouts]),
        f"{prefix}truncation_rate": _mean([float(r.truncated) for r in rollouts]),
        f"{prefix}sandbox_s": sum(r.sandbox_time_s for r in rollouts),
        f"{prefix}score_errors": float(sum(r.error is not None for r in rollouts)),
        f"{prefix}rollouts": float(len(rollouts)),
    }
    names: list[str] = []
    for rollout in rollouts:
        names.extend(name for name in rollout.components if name not in names)
    for name in names:
        # A rollout whose scorer failed has no components: it counts as 0, like its reward.
        out[f"{prefix}reward/{name}"] = _mean([r.components.get(name, 0.0) for r in rollouts])
    return out


def domain_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """`rollout_metrics` over all rollouts, then again per environment under `domain/<env>/`."""
    out = rollout_metrics(rollouts)
    by_env: dict[str, list[Rollout]] = {}
    for rollout in rollouts:
        by_env.setdefault(rollout.env, []).append(rollout)
    for env, group in by_env.items():
        out.update(rollout_metrics(group, prefix=f"domain/{env}/"))
    return out


def staleness(rollouts: Sequence[Rollout], policy_version: int) -> dict[str, float]:
    """How many versions behind the learner's current policy the generated tokens are."""
    lags = [policy_version - v for r in rollouts for v in r.generated_versions]
    return {
        "staleness_mean": _mean([float(lag) for lag in lags]),
        "staleness_max": float(max(lags, default=0)),
    }
