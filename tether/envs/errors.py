"""The error every environment module raises for input a user (or a model's tool call) got wrong."""

from __future__ import annotations

from tether.errors import TetherError


class EnvError(TetherError, ValueError):
    """A bad environment name, seed, answer file, mixture or task that a user can fix."""
