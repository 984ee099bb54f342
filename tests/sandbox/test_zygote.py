"""The zygote's fingerprint, computed in this process over a stand-in staging folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tether.sandbox import zygote


def test_a_fingerprint_that_keeps_no_mounted_directory_equals_the_plain_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker's baseline is taken with nothing kept, and each run of a session is checked with its
    # directory kept: the two ways of hashing the mount table must agree where they keep the same.
    monkeypatch.setattr(zygote, "STAGING", str(tmp_path))
    listdir = os.listdir
    # This host's other processes come and go between two calls: the worker's PID namespace holds
    # only its own, so the process list is held still here.
    monkeypatch.setattr(zygote.os, "listdir", lambda path: ["1"] if path == "/proc" else listdir(path))
    (tmp_path / "r1").mkdir()
    assert zygote.fingerprint(frozenset({"not-mounted"})) == zygote.fingerprint()
    assert zygote.fingerprint(frozenset({"r1"})) != zygote.fingerprint(), "a kept directory is left out"


def test_the_worker_starts_without_the_modules_it_has_no_use_for_at_start() -> None:
    # Every worker start (each slot, each replacement) imports the zygote in a fresh `python -I -S`:
    # typing, OpenSSL's hashlib and traceback (with textwrap) were a third of those imports.
    root = str(Path(zygote.__file__).resolve().parents[2])
    unused = "{'typing', '_hashlib', 'traceback', 'textwrap', 'shutil'}"
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import tether.sandbox.zygote; "
        f"print(' '.join(sorted({unused} & set(sys.modules))))"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", probe, root], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == ""
