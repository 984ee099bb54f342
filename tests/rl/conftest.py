"""RL fixtures: tiny random checkpoints (seconds to build), shared across the session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tether.models import configure_threads
from tether.testing import make_tiny_model


@pytest.fixture(scope="session", autouse=True)
def torch_threads() -> int:
    return configure_threads()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(architecture: str) -> Path:
        if architecture not in made:
            made[architecture] = make_tiny_model(tmp_path_factory.mktemp(architecture), architecture)
        return made[architecture]

    return get
