"""Shared test configuration: which optional services exist, and skips for what this machine lacks."""

from __future__ import annotations

import os

import pytest


def services_disabled() -> bool:
    return os.environ.get("TETHER_NO_SERVICES") == "1"


@pytest.fixture
def no_services() -> bool:
    return services_disabled()
