"""Content-addressed artifact store (workdir snapshots) on the local filesystem or any fsspec URL.

`put` names a blob by its SHA-256, so writing the same snapshot twice is free and a key, once returned,
always means the same bytes. Writes go to a temporary name first and are renamed, so a reader never sees
a half-written blob (on object stores the upload itself is atomic). Nothing is ever deleted here.
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

from fsspec.core import url_to_fs  # type: ignore[import-untyped]  # fsspec ships no type hints

from tether.errors import ConfigError, TetherError

_HEX = frozenset("0123456789abcdef")


class ArtifactMissing(TetherError, LookupError):
    """A key the journal names is not in the artifact store (wrong --artifacts location?)."""


class ArtifactStore:
    def __init__(self, url: str) -> None:
        """`url` is a directory path or an fsspec URL (`file:///dir`, `s3://bucket/prefix`, `memory://x`)."""
        if not url:
            raise ConfigError("artifact store url is empty; give a directory or an fsspec URL")
        try:
            fs, root = url_to_fs(url)
        except (ValueError, ImportError) as error:
            raise ConfigError(f"artifact store url {url!r}: {error}") from None
        self.url = url
        self._fs = fs
        self._root = root.rstrip("/")
        self._fs.makedirs(self._root, exist_ok=True)

    def _path(self, key: str) -> str:
        if not (key.startswith("sha256/") and len(key) == 71 and all(c in _HEX for c in key[7:])):
            raise ConfigError(f"artifact key {key!r} is not of the form sha256/<64 hex digits>")
        return f"{self._root}/{key[:9]}/{key}"

    def put(self, data: bytes) -> str:
        key = "sha256/" + hashlib.sha256(data).hexdigest()
        path = self._path(key)
        if self._fs.exists(path):
            return key
        self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        staging = f"{path}.{uuid.uuid4().hex}.tmp"
        self._fs.pipe_file(staging, data)
        self._fs.mv(staging, path)
        return key

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            data: bytes = self._fs.cat_file(path)
        except FileNotFoundError:
            raise ArtifactMissing(f"artifact {key} is not in {self.url}") from None
        if "sha256/" + hashlib.sha256(data).hexdigest() != key:
            raise TetherError(f"artifact {key} in {self.url} is corrupt (its content hash differs)")
        return data


def local_artifact_store(directory: Path) -> ArtifactStore:
    return ArtifactStore(str(directory))
