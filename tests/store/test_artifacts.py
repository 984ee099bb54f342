"""The content-addressed artifact store on a local directory and on another fsspec file system."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tether.errors import ConfigError, TetherError
from tether.store import ArtifactMissing, ArtifactStore


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    if request.param == "local":
        return ArtifactStore(str(tmp_path / "artifacts"))
    return ArtifactStore(f"memory://tether-{uuid.uuid4().hex}")


def test_a_blob_is_named_by_its_content_and_stored_once(store: ArtifactStore) -> None:
    key = store.put(b"snapshot")
    assert key == store.put(b"snapshot")
    assert key.startswith("sha256/") and len(key) == 71
    assert store.get(key) == b"snapshot"
    assert store.put(b"other") != key


def test_a_missing_blob_names_the_key_and_the_store(store: ArtifactStore) -> None:
    with pytest.raises(ArtifactMissing, match=r"sha256/0+ is not in"):
        store.get("sha256/" + "0" * 64)


def test_a_corrupted_blob_is_detected(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    key = store.put(b"good")
    (tmp_path / key[:9] / key).write_bytes(b"evil")
    with pytest.raises(TetherError, match="corrupt"):
        store.get(key)


@pytest.mark.parametrize(
    "key", ["../../etc/passwd", "sha256/../../x", "md5/abc", "sha256/" + "g" * 64, "sha256/" + "A" * 64]
)
def test_keys_that_are_not_content_hashes_are_rejected(key: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not of the form sha256/"):
        ArtifactStore(str(tmp_path)).get(key)


@pytest.mark.parametrize("url", ["", "nosuchproto://bucket/x"])
def test_bad_store_urls_are_rejected(url: str) -> None:
    with pytest.raises(ConfigError, match="artifact store url"):
        ArtifactStore(url)
