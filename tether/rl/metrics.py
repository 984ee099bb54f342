"""Step metrics from rollouts: overall and per domain (reward, each component, pass rate, lengths...).

Pure functions over plain data; the trainer adds timings and learner statistics and writes the dict as one
line of `metrics.jsonl`. Keys are flat (`domain/<env>/reward`) so that any log viewer can plot them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from tether.rl.rollout import Rollout


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def rollout_metrics(rollouts: Sequence[Rollout], prefix: str = "") -> dict[str, float]:
    """Reward, components, pass rate, response length, truncation, sandbox time, errors and
    infrastructure failures of a set. Rewards and pass rates are over the scored rollouts only: an
    infra-failed one has no reward (it is counted under `rollout/infra_failed`)."""
    scored = [r for r in rollouts if r.infra_failure is None]
    out = {
        f"{prefix}reward": _mean([r.reward for r in scored]),
        f"{prefix}pass_rate": _mean([float(r.passed) for r in scored]),
        f"{prefix}response_tokens": _mean([float(r.generated_tokens) for r in rollouts]),
        f"{prefix}turns": _mean([float(max(len(r.turns), 1)) for r in rollouts]),
        f"{prefix}truncation_rate": _mean([float(r.truncated) for r in rollouts]),
        f"{prefix}sandbox_s": sum(r.sandbox_time_s for r in rollouts),
        f"{prefix}score_errors": float(sum(r.error is not None for r in rollouts)),
        f"{prefix}rollouts": float(len(rollouts)),
        **failure_counts(rollouts, prefix),
    }
    names: list[str] = []
    for rollout in scored:
        names.extend(name for name in rollout.components if name not in names)
    for name in names:
        # A scored rollout lacking a component (another rubric's) counts as 0 for it.
        out[f"{prefix}reward/{name}"] = _mean([r.components.get(name, 0.0) for r in scored])
    return out


def failure_counts(rollouts: Sequence[Rollout], prefix: str = "") -> dict[str, float]:
    """`rollout/infra_failed` (left out of the advantages after their retries) and `rollout/retried`
    (tries made again), each also per reason; the share of rollouts that failed."""
    failed = Counter(r.infra_failure for r in rollouts if r.infra_failure is not None)
    retried = Counter(reason for r in rollouts for reason in r.retry_reasons)
    out = {
        f"{prefix}rollout/infra_failed": float(sum(failed.values())),
        f"{prefix}rollout/infra_failure_rate": sum(failed.values()) / len(rollouts) if rollouts else 0.0,
        f"{prefix}rollout/retried": float(sum(retried.values())),
    }
    for key, counts in (("infra_failed", failed), ("retried", retried)):
        out.update({f"{prefix}rollout/{key}/{reason}": float(n) for reason, n in sorted(counts.items())})
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


def add_counters(metrics: dict[str, float], counters: Mapping[str, float]) -> None:
    """Add a rollout source's counters (`Generated.counters`) into the step's metrics: a count both
    name (requests a source re-issued, `rollout/retried/worker_lost`) is summed, and `rollout/retried`
    stays the sum of its reasons."""
    for key, value in counters.items():
        metrics[key] = metrics.get(key, 0.0) + value
    reasons = [key for key in metrics if key.startswith(_RETRIED + "/")]
    if reasons:
        metrics[_RETRIED] = sum(metrics[key] for key in reasons)


_RETRIED = "rollout/retried"


def staleness(rollouts: Sequence[Rollout], policy_version: int) -> dict[str, float]:
    """How many versions behind the learner's current policy the generated tokens are."""
    lags = [policy_version - v for r in rollouts for v in r.generated_versions]
    return {
        "staleness_mean": _mean([float(lag) for lag in lags]),
        "staleness_max": float(max(lags, default=0)),
    }
