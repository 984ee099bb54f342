"""Where a path that a caller names lands in a run (pure): the working directory or another writable root.

A run can write to four directories, all on its own tmpfs and gone with it (or with its session): the
working directory (`/workspace` by default), `/tmp`, `/dev/shm` and `/mnt`, the scratch directory of
SandboxFusion's image. Files given to a run and collected from it are named relative to the working
directory, or, as SandboxFusion accepts them, by an absolute path inside one of those roots. A path that
would leave them (`..` climbing out, any other absolute path, NUL) is refused here; symlinks a run
planted are refused by the worker when it opens the file (`zygote._inside`), since only it sees them.
A session's programs live in PROGRAM_DIR, outside every root a caller can name.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

PROGRAM_DIR = "/.program"
WORK_FOLDER = "work"
# The writable roots besides the working directory: the path a run sees -> its folder in the run directory.
FIXED_ROOTS = {"/tmp": "tmp", "/dev/shm": "shm", "/mnt": "mnt"}


@dataclass(frozen=True, slots=True)
class RunPath:
    folder: str  # folder of the run directory that backs the root: work, tmp, shm or mnt
    relative: str  # normalised and non-empty, inside that folder


def writable_roots(workdir: str) -> dict[str, str]:
    """Every root a run can write to, as it sees it, -> the folder of its run directory behind it."""
    return {workdir.rstrip("/"): WORK_FOLDER, **FIXED_ROOTS}


def locate(path: str, workdir: str) -> RunPath:
    """The run-directory folder and relative path that `path` names; a ValueError says what is accepted."""
    roots = writable_roots(workdir)
    accepted = f"relative to the working directory or absolute under {', '.join(roots)}"
    if not path or "\0" in path:
        raise ValueError(f"path {path!r} must be {accepted}, without NUL")
    # normpath keeps a leading '//', which then matches no root: refused like any other odd absolute path.
    normal = posixpath.normpath(path)
    if path.startswith("/"):
        for root, folder in roots.items():
            if normal.startswith(root + "/"):
                return RunPath(folder, normal[len(root) + 1 :])
        raise ValueError(
            f"path {path!r} is outside the sandbox's writable directories: it must be {accepted}"
        )
    if normal in (".", "..") or normal.startswith("../"):
        raise ValueError(f"path {path!r} leaves the working directory: it must be {accepted}")
    return RunPath(WORK_FOLDER, normal)
