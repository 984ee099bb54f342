"""Long-horizon repository tasks (`long/<task>`): implement a small multi-module package so that its
test suite passes, through many tool calls in a sandbox session; partial credit per hidden test."""

from functools import partial

from tether.envs.long_horizon.env import TASKS, long_env
from tether.envs.long_horizon.repo import Repo
from tether.envs.registry import EnvRegistry

__all__ = ["TASKS", "Repo", "long_env", "register"]


def register(registry: EnvRegistry) -> None:
    for name in TASKS:
        registry.register(f"long/{name}", partial(long_env, name), source=__name__)
