"""Quality checks on a multi-turn episode's sandbox state: a clean start, and protected files kept intact.

`start_clean` runs in the setup hook before any fixture is written: the session's working directory
and /tmp must hold nothing but the sandbox's own launcher files, so that no episode inherits another's
leftovers. `protect` records the SHA-256 of the protected files (tests, graders, task statements) once
the fixtures are in place, and `protected_files_unchanged` re-checks them after every step; a file
that changed, vanished, or became a link or a directory is a violation that ends the episode at 0.
The checks run as trusted programs in the session (see `sandboxed.py`); nothing here trusts a path or
a listing the model could have written.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from tether.envs.episode import StepValidator
from tether.envs.sandboxed import run_trusted
from tether.envs.scoring import EpisodeState

# Files a run writes itself beside the model's (the code harness); never the model's doing. A session's
# own programs live outside its working directory, so a main.py there is the model's.
LAUNCHER_FILES = frozenset({"harness.bin"})
_PROTECTED = "qc.protected"
_VIOLATION = "qc.setup_violation"

CHECKSUM_BODY = """
import hashlib, stat, sys
def digest(path):
    try:
        info = _os.lstat(path)
    except FileNotFoundError:
        return 'missing'
    if not stat.S_ISREG(info.st_mode):
        return 'not a regular file'
    try:
        with open(path, 'rb') as handle:
            return hashlib.sha256(handle.read()).hexdigest()
    except OSError as error:
        return 'unreadable: ' + type(error).__name__
report({path: digest(path) for path in _json.loads(sys.stdin.read())})
"""

# Entries the run user does not own are the sandbox's own scaffolding (e.g. the mount points that keep a
# Python installed under /tmp visible), never files an earlier run could have left behind.
LISTING_BODY = """
import sys
found = {}
for root in ('.', '/tmp'):
    try:
        names = _os.listdir(root)
        found[root] = sorted(
            name for name in names
            if _os.lstat(_os.path.join(root, name)).st_uid == _os.getuid()
        )
    except OSError as error:
        found[root] = ['<unreadable: ' + type(error).__name__ + '>']
report(found)
"""


async def checksums(state: EpisodeState, paths: Sequence[str]) -> dict[str, str]:
    """SHA-256 of each path in the session (or why there is none); raises if the check cannot run."""
    result = await run_trusted(state, CHECKSUM_BODY, stdin=json.dumps(list(paths)))
    if result.data is None:
        raise RuntimeError(f"checksum run failed: {result.error}")
    return {str(k): str(v) for k, v in result.data.items()}


async def start_clean(state: EpisodeState) -> None:
    """Record a violation if the fresh session already holds files (call before writing fixtures)."""
    listing = await run_trusted(state, LISTING_BODY)
    if listing.data is None:
        state.info[_VIOLATION] = f"cannot list the fresh workspace: {listing.error}"
        return
    leftovers = [
        f"{root}/{name}"
        for root, names in listing.data.items()
        for name in names
        if name not in LAUNCHER_FILES
    ]
    if leftovers:
        state.info[_VIOLATION] = f"workspace polluted before the episode: {', '.join(leftovers[:10])}"


async def protect(state: EpisodeState, paths: Sequence[str]) -> None:
    """Remember the protected files' checksums (call after writing fixtures)."""
    sums = await checksums(state, paths)
    bad = {path: value for path, value in sums.items() if len(value) != 64}
    if bad:
        raise RuntimeError(f"protected fixture files are not in place: {bad}")
    state.info[_PROTECTED] = sums


def violation_after_step(before: dict[str, str], after: dict[str, str]) -> str | None:
    """The first difference between two checksum maps, as a reason (pure)."""
    for path, digest in before.items():
        now = after.get(path, "missing")
        if now != digest:
            what = "changed" if len(now) == 64 else now
            return f"protected file {path} {what}"
    return None


async def protected_files_unchanged(state: EpisodeState) -> str | None:
    """The step validator: a setup violation, or a protected file that no longer matches its checksum."""
    if _VIOLATION in state.info:
        return str(state.info[_VIOLATION])
    before: dict[str, str] = state.info.get(_PROTECTED, {})
    if not before:
        return None
    try:
        after = await checksums(state, list(before))
    except RuntimeError as error:
        return f"protected files could not be checked: {error}"
    return violation_after_step(before, after)


def validators() -> tuple[StepValidator, ...]:
    return (protected_files_unchanged,)
