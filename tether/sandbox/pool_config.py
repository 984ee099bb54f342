"""`PoolConfig`: how a `SandboxPool` runs its workers (slots, spares, queue bound, identity, paths).

The limits of each run live in `SandboxSpec`; this is the pool's own shape, checked on construction.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field

from tether.errors import ConfigError
from tether.sandbox.paths import FIXED_ROOTS, PROGRAM_DIR
from tether.sandbox.rootfs import ALIAS_ROOT, STAGING

INSTANCE_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")
SESSION_SEPARATOR = "~"  # between the instance name and the session's own id: unreserved in URLs

# What reward and test code imports most, and cheap to carry into every fork (each MiB of heap the
# worker holds costs every run a little at fork and exit); anything else is imported on demand.
DEFAULT_PRELOAD = (
    "bisect",
    "collections",
    "copy",
    "functools",
    "heapq",
    "itertools",
    "json",
    "math",
    "operator",
    "random",
    "re",
    "string",
    "typing",
)
DEFAULT_READONLY = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICE_NODES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
INITIAL_NAMESPACE_ID_FLOOR = 65536  # host ids below are the machine's own users and services


def unprivileged_id_floor(uid_map: str) -> int:
    """The lowest host id the sandbox may map its users onto, given this process's `/proc/self/uid_map`.

    In the initial user namespace (the identity map) ids below 65536 are real users of the machine. Inside
    a user namespace (a Kubernetes `hostUsers: false` pod, which sees only ids 0-65535), every id already
    maps to an unprivileged id outside, so any id but 0 will do."""
    identity = [line.split() for line in uid_map.splitlines() if line.strip()] == [["0", "0", "4294967295"]]
    return INITIAL_NAMESPACE_ID_FLOOR if identity else 1


def _own_uid_map() -> str:
    try:
        with open("/proc/self/uid_map") as handle:
            return handle.read()
    except OSError:  # no /proc: take the strict floor
        return "0 0 4294967295\n"


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """How the pool runs its workers. Limits of each run live in `SandboxSpec`."""

    slots: int = field(default_factory=lambda: max(os.cpu_count() or 1, 1))
    host_uid_base: int = 1_000_000  # unprivileged host uid of the namespace root; runs get base+run_uid
    run_uid: int = 1000
    workdir: str = "/workspace"
    extra_readonly_paths: tuple[str, ...] = ()
    preload_modules: tuple[str, ...] = DEFAULT_PRELOAD
    python_executable: str = sys.executable
    insecure: bool = False
    max_runs_per_worker: int = 5000
    worker_start_timeout_s: float = 30.0
    session_idle_timeout_s: float = 600.0
    session_wait_s: float = 10.0  # how long opening a session waits for a free slot before NoFreeSlot
    # Spare warm workers kept started beyond the slots: a discarded worker's slot takes a spare at once
    # (and a new spare starts in the background), so a burst never waits for a worker to start.
    warm_target: int = 0
    # Runs that may wait for a slot; beyond, a run is refused at once with NoFreeSlot (a server: 503 +
    # Retry-After) rather than queued without bound. None: unbounded (a pool of one process's own runs).
    max_queued: int | None = None
    # Names this pool's sessions (`NAME~s<hex>`), so a fleet client or router knows where one lives.
    instance_name: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.slots <= 1024:
            raise ConfigError(f"slots = {self.slots!r}: must be between 1 and 1024")
        if not 1 <= self.run_uid < 65536:
            raise ConfigError(f"run_uid = {self.run_uid!r}: must be between 1 and 65535")
        if self.session_idle_timeout_s <= 0:
            raise ConfigError(f"session_idle_timeout_s = {self.session_idle_timeout_s!r}: must be positive")
        if self.session_wait_s <= 0:
            raise ConfigError(f"session_wait_s = {self.session_wait_s!r}: must be positive")
        if not 0 <= self.warm_target <= 1024:
            raise ConfigError(f"warm_target = {self.warm_target!r}: must be between 0 and 1024")
        if self.max_queued is not None and self.max_queued < 0:
            raise ConfigError(f"max_queued = {self.max_queued!r}: must not be negative (or None: unbounded)")
        if self.instance_name and not INSTANCE_NAME.fullmatch(self.instance_name):
            raise ConfigError(
                f"instance_name = {self.instance_name!r}: use 1-128 of letters, digits and . _ : -"
            )
        floor = unprivileged_id_floor(_own_uid_map())
        if self.host_uid_base < floor:
            where = "outside a user namespace" if floor > 1 else "inside this user namespace"
            raise ConfigError(
                f"host_uid_base = {self.host_uid_base!r}: must be at least {floor} {where} (unprivileged)"
            )
        reserved = (*FIXED_ROOTS, "/dev", "/proc", PROGRAM_DIR, STAGING, ALIAS_ROOT)
        normal = "/" + os.path.normpath(self.workdir).lstrip("/")  # '//tmp' is /tmp too
        if not self.workdir.startswith("/") or any(
            normal in ("/", root) or normal.startswith(root + "/") or root.startswith(normal + "/")
            for root in reserved
        ):
            raise ConfigError(
                f"workdir = {self.workdir!r}: must be an absolute path that neither holds nor lies in "
                f"{', '.join(reserved)}"
            )

    def readonly_paths(self) -> list[str]:
        """System and Python directories, plus tether's own package (the fork server imports it)."""
        prefixes = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(self.python_executable))}
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return [*DEFAULT_READONLY, *sorted(prefixes), package, *self.extra_readonly_paths]
