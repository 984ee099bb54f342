"""Model fixtures: torch threads and the real SmolLM2 converted once per run (tiny ones: tests/conftest.py).

The real model is pulled into the repository's `.tether/` (git-ignored): a fresh clone, as in CI,
installs and converts it once (about 20 s) and every later run reuses the folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tether.models import configure_threads, pull

REPO_CACHE = Path(__file__).resolve().parents[2] / ".tether" / "cache"
SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session", autouse=True)
def torch_threads() -> int:
    return configure_threads()


@pytest.fixture(scope="session")
def model_cache() -> Path:
    return REPO_CACHE


@pytest.fixture(scope="session")
def smollm2_folder(model_cache: Path) -> Path:
    return pull(SMOLLM2, model_cache)
