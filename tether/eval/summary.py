"""Per-domain summaries of evaluated episodes: mean reward, pass rate, tokens, sandbox time and the mean of
every reward component. Pure: records in, rows out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tether.eval.runner import EpisodeRecord


@dataclass(frozen=True, slots=True)
class DomainSummary:
    env: str
    episodes: int
    mean_reward: float
    pass_rate: float
    mean_completion_tokens: float
    sandbox_time_s: float
    errors: int
    components: dict[str, float]  # mean of each reward component over the scored episodes

    def to_dict(self) -> dict[str, Any]:
        return {
            "env": self.env,
            "episodes": self.episodes,
            "mean_reward": self.mean_reward,
            "pass_rate": self.pass_rate,
            "mean_completion_tokens": self.mean_completion_tokens,
            "sandbox_time_s": self.sandbox_time_s,
            "errors": self.errors,
            "components": self.components,
        }


def summarise(records: Sequence[EpisodeRecord]) -> list[DomainSummary]:
    """One row per environment, in first-seen order; failed episodes count as reward 0."""
    by_env: dict[str, list[EpisodeRecord]] = {}
    for record in records:
        by_env.setdefault(record.env, []).append(record)
    rows = []
    for env, group in by_env.items():
        scored = [r.score for r in group if r.score is not None]
        names = list(scored[0].components) if scored else []
        rows.append(
            DomainSummary(
                env=env,
                episodes=len(group),
                mean_reward=sum(r.reward for r in group) / len(group),
                pass_rate=sum(bool(r.score and r.score.passed) for r in group) / len(group),
                mean_completion_tokens=sum(r.completion_tokens for r in group) / len(group),
                sandbox_time_s=sum(s.sandbox_time_s for s in scored),
                errors=sum(r.error is not None for r in group),
                components={n: sum(s.components[n] for s in scored) / len(scored) for n in names},
            )
        )
    return rows
