"""Evaluation: episodes of many environments run against a model, summarised per domain."""
