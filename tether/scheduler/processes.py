"""Process-group plumbing of the local back end: is a process or group alive, signal and kill it, ports.

Every job's processes share one process group (led by its first replica), apart from the supervisor, so
that a stop reaches all of them and none of its own children survive it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in the group; zombies wait on their reaper."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pgid, os.WNOHANG)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if state != "Z" and int(group) == pgid:
            return True
    return False


def signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def wait_group(pgid: int, timeout_s: float) -> bool:
    """Wait until the group is gone; whether it went within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def kill_group(pgid: int, grace_s: float) -> None:
    """SIGTERM the group, then SIGKILL whatever is left after `grace_s`; returns once it is gone."""
    signal_group(pgid, signal.SIGTERM)
    if not wait_group(pgid, grace_s):
        signal_group(pgid, signal.SIGKILL)
        # SIGKILL is delivered asynchronously; return once the group is really gone.
        wait_group(pgid, grace_s)


def free_ports(count: int) -> tuple[int, ...]:
    """`count` distinct TCP ports free on 127.0.0.1 now (the OS picks them)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return tuple(sock.getsockname()[1] for sock in sockets)
    finally:
        for sock in sockets:
            sock.close()
