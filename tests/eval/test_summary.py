"""Per-domain summaries: one row per environment in first-seen order, failures counted as reward 0."""

from __future__ import annotations

from tether.envs.scoring import Score
from tether.eval.runner import EpisodeRecord
from tether.eval.summary import summarise


def _record(env: str, total: float, tokens: int = 4, error: str | None = None) -> EpisodeRecord:
    components = {"correctness": total, "format": 1.0}
    weights = {"correctness": 0.9, "format": 0.1}
    score = None if error else Score(total, components, weights, total == 1.0, sandbox_time_s=0.5)
    return EpisodeRecord(env, 0, "ref", score, turns=1, completion_tokens=tokens, error=error)


def test_summaries_separate_domains_and_average_each_component() -> None:
    rows = summarise([_record("a/x", 1.0), _record("b/y", 0.0, tokens=8), _record("a/x", 0.0, tokens=2)])
    assert [row.env for row in rows] == ["a/x", "b/y"]
    first = rows[0]
    assert (first.episodes, first.mean_reward, first.mean_completion_tokens) == (2, 0.5, 3.0)
    assert first.components == {"correctness": 0.5, "format": 1.0} and first.sandbox_time_s == 1.0
    assert rows[1].to_dict()["mean_reward"] == 0.0


def test_failed_episodes_count_as_reward_zero_and_as_errors() -> None:
    [row] = summarise([_record("a/x", 1.0), _record("a/x", 0.0, error="RuntimeError: down")])
    assert (row.episodes, row.mean_reward, row.errors, row.pass_rate) == (2, 0.5, 1, 0.5)
    assert row.components == {"correctness": 1.0, "format": 1.0}  # over the scored episodes only
