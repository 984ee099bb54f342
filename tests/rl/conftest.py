"""RL fixtures: torch threads sized once per session (tiny checkpoints come from tests/conftest.py)."""

from __future__ import annotations

import pytest

from tether.models import configure_threads


@pytest.fixture(scope="session", autouse=True)
def torch_threads() -> int:
    return configure_threads()
