"""The warm runner's rehearsal leaves the fork server exactly as it found it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tether.sandbox.child import rehearse


def test_rehearsal_restores_interpreter_state(tmp_path: Path) -> None:
    script = tmp_path / "rehearsal.py"
    before = (
        sys.stdin,
        sys.stdout,
        sys.stderr,
        list(sys.argv),
        list(sys.path),
        sys.modules["__main__"],
        dict(os.environ),
        [os.readlink(f"/proc/self/fd/{fd}") for fd in (0, 1, 2)],
    )
    rehearse(str(script), rounds=2)
    after = (
        sys.stdin,
        sys.stdout,
        sys.stderr,
        list(sys.argv),
        list(sys.path),
        sys.modules["__main__"],
        dict(os.environ),
        [os.readlink(f"/proc/self/fd/{fd}") for fd in (0, 1, 2)],
    )
    assert after == before
    assert not script.exists()
