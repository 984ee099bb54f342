"""Thin ctypes wrappers over the Linux calls the sandbox needs and Python 3.11 lacks.

Only system calls live here; what to call, in which order, is decided by `isolation.py`.
"""

from __future__ import annotations

import ctypes
import os
from enum import IntFlag

# The process's own symbols, libc's among them: `ctypes.util.find_library` would run ldconfig in a
# subprocess at every worker start.
_libc = ctypes.CDLL(None, use_errno=True)


class Clone(IntFlag):
    NEWNS = 0x00020000
    NEWCGROUP = 0x02000000
    NEWUTS = 0x04000000
    NEWIPC = 0x08000000
    NEWUSER = 0x10000000
    NEWPID = 0x20000000
    NEWNET = 0x40000000


class Mount(IntFlag):
    RDONLY = 0x1
    NOSUID = 0x2
    NODEV = 0x4
    NOEXEC = 0x8
    REMOUNT = 0x20
    NOATIME = 0x400
    BIND = 0x1000
    REC = 0x4000
    PRIVATE = 0x40000
    STRICTATIME = 0x1000000


MNT_DETACH = 0x2
PR_SET_PDEATHSIG = 1

# statvfs f_flag bits that a user namespace may not drop on a bind remount (they are "locked").
_ST_LOCKED = {
    os.ST_RDONLY: Mount.RDONLY,
    os.ST_NOSUID: Mount.NOSUID,
    os.ST_NODEV: Mount.NODEV,
    os.ST_NOEXEC: Mount.NOEXEC,
}


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def unshare(flags: int) -> None:
    if _libc.unshare(ctypes.c_int(flags)) != 0:  # the message is built only on failure: this is per run
        _check(-1, f"unshare({Clone(flags)!r})")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def umount(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    syscall_pivot_root = 155
    _check(_libc.syscall(syscall_pivot_root, new_root.encode(), put_old.encode()), "pivot_root")


def locked_mount_flags(path: str) -> int:
    """Flags of the mount holding `path` that a remount inside a user namespace must keep."""
    flags = os.statvfs(path).f_flag
    result = 0
    for st_flag, ms_flag in _ST_LOCKED.items():
        if flags & st_flag:
            result |= ms_flag
    return result


def prctl(option: int, arg2: int = 0) -> None:
    _check(
        _libc.prctl(
            ctypes.c_int(option),
            ctypes.c_ulong(arg2),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        ),
        f"prctl({option})",
    )


def read_kernel_log(size: int = 1 << 16) -> str:
    """The kernel's message buffer (what dmesg prints), or "" where this process may not read it."""
    syslog_action_read_all = 3
    buffer = ctypes.create_string_buffer(size)
    count = _libc.klogctl(ctypes.c_int(syslog_action_read_all), buffer, ctypes.c_int(size))
    return buffer.raw[: max(count, 0)].decode(errors="replace")


def set_process_name(name: str) -> None:
    """Name the calling thread (what `ps` and `top` show), at most 15 bytes."""
    pr_set_name = 15
    buffer = ctypes.create_string_buffer(name.encode()[:15])
    _check(
        _libc.prctl(
            ctypes.c_int(pr_set_name), buffer, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)
        ),
        "prctl(PR_SET_NAME)",
    )
