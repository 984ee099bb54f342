"""Shared test configuration: which optional services exist, and skips for what this machine lacks."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.placement import PLACEMENTS, Placement


def services_disabled() -> bool:
    return os.environ.get("TETHER_NO_SERVICES") == "1"


@pytest.fixture
def no_services() -> bool:
    return services_disabled()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Tiny random checkpoints by architecture, built once per test session (seconds each)."""
    from tether.testing import make_tiny_model  # torch: only for the tests that ask for a model

    made: dict[str, Path] = {}

    def get(architecture: str) -> Path:
        if architecture not in made:
            made[architecture] = make_tiny_model(tmp_path_factory.mktemp(architecture), architecture)
        return made[architecture]

    return get


@pytest.fixture(params=PLACEMENTS)
def placement(request: pytest.FixtureRequest) -> Placement:
    """One of `PLACEMENTS`; a CUDA one is skipped on a machine without CUDA."""
    chosen: Placement = request.param
    if chosen.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
    return chosen


SMOLLM2 = "smollm2-135m-instruct"
REPO_CACHE = Path(__file__).resolve().parents[1] / ".tether" / "cache"


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The real SmolLM2-135M-Instruct, converted once into the repository's cache (`make test` does it)."""
    from tether.models.cache import pull

    return pull(SMOLLM2, REPO_CACHE)
