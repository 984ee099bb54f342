"""The warm runner's rehearsal leaves the fork server exactly as it found it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from tether.sandbox.child import rehearse


def interpreter_state() -> tuple[Any, ...]:
    """What a rehearsal touches: standard streams and their descriptors, argv, path, __main__, environ."""
    descriptors = [os.readlink(f"/proc/self/fd/{fd}") for fd in (0, 1, 2)]
    return (
        sys.stdin,
        sys.stdout,
        sys.stderr,
        list(sys.argv),
        list(sys.path),
        sys.modules["__main__"],
        dict(os.environ),
        descriptors,
    )


def test_rehearsal_restores_interpreter_state(tmp_path: Path) -> None:
    script = tmp_path / "rehearsal.py"
    before = interpreter_state()
    rehearse(str(script), rounds=2)
    assert interpreter_state() == before
    assert not script.exists()
