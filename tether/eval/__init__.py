"""Evaluation: episodes of many environments run against a model, summarised per domain."""

from tether.eval.runner import EpisodeRecord, EvalSettings, plan_episodes, run_eval
from tether.eval.summary import DomainSummary, summarise

__all__ = ["DomainSummary", "EpisodeRecord", "EvalSettings", "plan_episodes", "run_eval", "summarise"]
