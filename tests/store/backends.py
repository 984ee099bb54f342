"""Journal back ends for tests: a fresh SQLite file, or unique tables in the real PostgreSQL service."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tether.store import Journal

POSTGRES_URL = os.environ.get("TETHER_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.services)]


def skip_without_services() -> None:
    if os.environ.get("TETHER_NO_SERVICES") == "1":
        pytest.skip("TETHER_NO_SERVICES=1: PostgreSQL/Redis/NATS are not available")


def journal_url(backend: str, tmp_path: Path) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'journal.db'}"
    skip_without_services()
    return POSTGRES_URL


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}_"


@contextmanager
def open_journal(backend: str, tmp_path: Path, prefix: str | None = None) -> Iterator[Journal]:
    journal = Journal(journal_url(backend, tmp_path), table_prefix=prefix or unique_prefix())
    try:
        yield journal
    finally:
        if backend == "postgres":
            journal.drop_schema()
        journal.close()
