"""Helpers for tests that ship with the library: tiny random models that load anywhere, offline."""

from tether.testing.tiny_models import TINY_ARCHITECTURES, TINY_WINDOW, make_tiny_classifier, make_tiny_model

__all__ = ["TINY_ARCHITECTURES", "TINY_WINDOW", "make_tiny_classifier", "make_tiny_model"]
