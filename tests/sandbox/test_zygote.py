"""The zygote's fingerprint, computed in this process over a stand-in staging folder."""

from __future__ import annotations

import os
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
