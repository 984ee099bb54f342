"""Reward-hacking monitors: per domain and step, signs that the policy is learning to game its reward.

- `qc_violation_rate`: share of scored rollouts that broke a rule of their environment (protected
  files, pollution: `Rollout.qc_violation`).
- `exploit_reward_share`: share of the domain's reward earned by completions that match a known exploit
  of its answer convention (`Environment.exploits_in`: answer-tag stuffing, printing the expected output).
- `reward_length_correlation`: Pearson correlation of reward and generated tokens (a reward that grows
  with length invites padding); computed from `correlation_min_rollouts` scored rollouts on.
- `judge_disagreement`: share of rollouts where a `judge` component and the programmatic reward (the
  mean of the other components) fall on different sides of 0.5; only where a judge scored.

Pure: values become metrics `monitor/<domain>/<name>` every step, and `over_thresholds` turns those above
their `[monitors]` threshold into warnings (the trainer's `warnings.jsonl`, the live view, the report).
Infra-failed rollouts are not the policy's doing and are left out. A warning says "look", not "stop".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tether.rl.report_sections import Monitor, MonitorsSection
from tether.rl.rollout import Rollout

PREFIX = "monitor/"
WARNINGS = "monitor/warnings"  # the step's count of monitors over their threshold
WARNINGS_FILE = "warnings.jsonl"
JUDGE = "judge"  # the reward component a judge writes (tether's judge reward's default name)


WHY = {
    Monitor.QC_VIOLATION_RATE: "episodes broke a rule of the environment (protected files, pollution)",
    Monitor.EXPLOIT_REWARD_SHARE: "reward came from answers matching a known exploit of the parser",
    Monitor.REWARD_LENGTH_CORRELATION: "reward rises with response length",
    Monitor.JUDGE_DISAGREEMENT: "the judge and the programmatic reward disagree",
}


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Pearson's r; 0.0 when either side is constant (no linear relation to speak of)."""
    assert len(xs) == len(ys) and xs, "paired, non-empty samples"
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    var_x = sum((x - mean_x) ** 2 for x in xs)
    var_y = sum((y - mean_y) ** 2 for y in ys)
    return cov / math.sqrt(var_x * var_y) if var_x > 0 and var_y > 0 else 0.0


def _programmatic(rollout: Rollout) -> float | None:
    others = [value for name, value in rollout.components.items() if name != JUDGE]
    return sum(others) / len(others) if others else None


def domain_monitors(
    rollouts: Sequence[Rollout], exploits: Callable[[Rollout], Sequence[str]], section: MonitorsSection
) -> dict[Monitor, float]:
    """The monitors of one domain's rollouts in a step (`exploits`: the exploit names a rollout matches)."""
    scored = [r for r in rollouts if r.infra_failure is None]
    if not scored:
        return {}
    total_reward = sum(r.reward for r in scored)
    exploited = sum(r.reward for r in scored if r.reward > 0 and exploits(r))
    out = {
        Monitor.QC_VIOLATION_RATE: sum(r.qc_violation is not None for r in scored) / len(scored),
        Monitor.EXPLOIT_REWARD_SHARE: exploited / total_reward if total_reward > 0 else 0.0,
    }
    if len(scored) >= section.correlation_min_rollouts:
        lengths = [float(r.generated_tokens) for r in scored]
        out[Monitor.REWARD_LENGTH_CORRELATION] = pearson([r.reward for r in scored], lengths)
    judged = [(r.components[JUDGE], _programmatic(r)) for r in scored if JUDGE in r.components]
    pairs = [(judge, other) for judge, other in judged if other is not None]
    if pairs:
        disagree = sum((judge >= 0.5) != (other >= 0.5) for judge, other in pairs)
        out[Monitor.JUDGE_DISAGREEMENT] = disagree / len(pairs)
    return out


def monitor_metrics(
    rollouts: Sequence[Rollout], exploits: Callable[[Rollout], Sequence[str]], section: MonitorsSection
) -> dict[str, float]:
    """Every domain's monitors as metrics `monitor/<domain>/<name>`."""
    by_env: dict[str, list[Rollout]] = {}
    for rollout in rollouts:
        by_env.setdefault(rollout.env, []).append(rollout)
    return {
        f"{PREFIX}{env}/{monitor.value}": value
        for env, group in by_env.items()
        for monitor, value in domain_monitors(group, exploits, section).items()
    }


@dataclass(frozen=True, slots=True)
class MonitorWarning:
    domain: str
    monitor: Monitor
    value: float
    threshold: float

    @property
    def message(self) -> str:
        return (
            f"{self.domain}: {self.monitor.value} {self.value:.3f} > {self.threshold:g} ({WHY[self.monitor]})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "domain": self.domain,
            "monitor": self.monitor.value,
            "value": self.value,
            "threshold": self.threshold,
            "message": self.message,
        }


def over_thresholds(metrics: Mapping[str, float], section: MonitorsSection) -> list[MonitorWarning]:
    """The monitors among `metrics` (`monitor/<family>/<name>/<monitor>`) above their threshold."""
    found = []
    for key, value in metrics.items():
        parts = key.removeprefix(PREFIX).split("/")
        if not key.startswith(PREFIX) or len(parts) != 3 or parts[2] not in Monitor._value2member_map_:
            continue
        monitor = Monitor(parts[2])
        if value > section.threshold(monitor):
            found.append(MonitorWarning(f"{parts[0]}/{parts[1]}", monitor, value, section.threshold(monitor)))
    return found
