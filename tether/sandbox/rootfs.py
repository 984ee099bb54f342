"""The private root view a worker pivots into: an allow-list of host paths, bound read-only.

Runs inside the worker's own user and mount namespaces, once per worker. Nothing of the host is
visible except the listed paths (never /tmp, /home, /root or the project tree), and none of it is
writable; per-run writable space is mounted later, by `_enter.c`. An allowed path under a directory a
run covers with its own tmpfs (a checkout in /tmp, say) is kept at ALIAS_ROOT + path, and each run binds
it back into place on top of its tmpfs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tether.sandbox import linux
from tether.sandbox.linux import MNT_DETACH, Mount
from tether.sandbox.paths import PROGRAM_DIR, writable_roots

STAGING = "/.staging"
ALIAS_ROOT = "/.ro"  # where allowed paths that a run's own mounts would cover are kept in the root view
_OLD_ROOT = ".oldroot"


def minimal_paths(paths: list[str]) -> list[str]:
    """Drop paths already covered by an ancestor in the list; keep order stable for reproducibility."""
    normalized = sorted({os.path.normpath(p) for p in paths})
    kept: list[str] = []
    for path in normalized:
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def _bind_readonly(source: str, target: str) -> None:
    linux.mount(source, target, None, Mount.BIND | Mount.REC)
    flags = linux.locked_mount_flags(target) | Mount.RDONLY | Mount.NOSUID
    linux.mount("none", target, None, Mount.REMOUNT | Mount.BIND | Mount.RDONLY | flags)


@dataclass(frozen=True, slots=True)
class _HostPath:
    path: str
    kind: str  # "link", "dir" or "file"
    link_target: str = ""
    fd: int = -1


def _open_host_paths(paths: list[str]) -> list[_HostPath]:
    """Open each allowed path while still host root, so 0700 parents such as /root can be crossed."""
    opened = []
    for path in minimal_paths(paths):
        if not os.path.lexists(path):
            continue
        if os.path.islink(path):
            opened.append(_HostPath(path, "link", os.readlink(path)))
            continue
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        opened.append(_HostPath(path, "dir" if os.path.isdir(path) else "file", fd=fd))
    return opened


def covered_by_run_mounts(path: str, workdir: str) -> bool:
    """Whether a run's own mounts (its writable roots and program directory) hide `path` in its view."""
    return any(path.startswith(directory + "/") for directory in (*writable_roots(workdir), PROGRAM_DIR))


def _place(new_root: str, host: _HostPath, workdir: str) -> None:
    """Mirror a host path into `new_root`: a symlink stays a symlink, anything else is bound read-only.

    A path that a run's own mounts cover is placed twice: where it is, for the worker itself, and under
    ALIAS_ROOT, from where each run binds it back.
    """
    view_paths = [host.path]
    if covered_by_run_mounts(host.path, workdir):
        view_paths.append(ALIAS_ROOT + host.path)
    for view_path in view_paths:
        target = new_root + view_path
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if host.kind == "link":
            if not os.path.lexists(target):
                os.symlink(host.link_target, target)
            continue
        if host.kind == "dir":
            os.makedirs(target, mode=0o755, exist_ok=True)
        else:
            with open(target, "w"):
                pass
        _bind_readonly(f"/proc/self/fd/{host.fd}", target)
    if host.fd >= 0:
        os.close(host.fd)


def build_root(
    skeleton_dir: str, readonly_paths: list[str], device_nodes: list[str], workdir: str
) -> list[tuple[str, str]]:
    """Build the root view on a tmpfs at `skeleton_dir`, pivot into it and seal it read-only.

    Returns the (alias, path) pairs each run must bind back over its own mounts.

    Called as host root inside the new user namespace; returns as the namespace's root user, which
    the host sees as an unprivileged uid. Files on the new tmpfs can only be created under a uid the
    namespace maps, hence the switch between opening the host paths and building the tree.
    """
    linux.mount("none", "/", None, Mount.REC | Mount.PRIVATE)
    host_paths = _open_host_paths(readonly_paths)
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    linux.mount("tmpfs", skeleton_dir, "tmpfs", Mount.NOSUID | Mount.NODEV, "mode=0755,size=1m")
    for host in host_paths:
        _place(skeleton_dir, host, workdir)
    os.makedirs(skeleton_dir + "/dev", mode=0o755, exist_ok=True)
    for node in device_nodes:
        target = skeleton_dir + node
        with open(target, "w"):
            pass
        linux.mount(node, target, None, Mount.BIND)
    for name, link in {
        "fd": "/proc/self/fd",
        "stdin": "/proc/self/fd/0",
        "stdout": "/proc/self/fd/1",
        "stderr": "/proc/self/fd/2",
    }.items():
        os.symlink(link, f"{skeleton_dir}/dev/{name}")
    mount_points = (*writable_roots(workdir), PROGRAM_DIR, "/proc", STAGING, f"/{_OLD_ROOT}")
    for directory in mount_points:
        os.makedirs(f"{skeleton_dir}{directory}", mode=0o755, exist_ok=True)
    # A user namespace may mount a new proc only while a fully visible one exists, so before the pivot.
    linux.mount("proc", f"{skeleton_dir}/proc", "proc", Mount.NOSUID | Mount.NODEV | Mount.NOEXEC)
    linux.pivot_root(skeleton_dir, f"{skeleton_dir}/{_OLD_ROOT}")
    os.chdir("/")
    linux.umount(f"/{_OLD_ROOT}", MNT_DETACH)
    os.rmdir(f"/{_OLD_ROOT}")
    linux.mount("tmpfs", STAGING, "tmpfs", Mount.NOSUID | Mount.NODEV, "mode=0700")
    linux.mount("none", "/", None, Mount.REMOUNT | Mount.BIND | Mount.RDONLY | Mount.NOSUID | Mount.NODEV)
    return [
        (ALIAS_ROOT + host.path, host.path)
        for host in host_paths
        if host.kind != "link" and covered_by_run_mounts(host.path, workdir)
    ]
