"""The fork server: the warm interpreter every run of a worker is forked from.

It is a fresh interpreter, exec'd by the zygote once its root view is built, not a fork of the zygote:
so it holds no remnant of any run (a warm Python run can read all the memory it inherits), and none
of the zygote's modules either (each mapping and page it carries costs every run at fork and exit).
It imports the preloaded modules, then, per request, forks a run as PID 1 of a new PID namespace,
answers the run's pidfd, and, once the run has exited, its wait status and CPU time (the run reaps
every descendant into its own rusage). It only ever receives descriptors: the plan is a memfd that
the forked child reads itself, so nothing a run sends or prints reaches this process's memory.

Started as `python -I -c "..." CHANNEL_FD`; the zygote then sends the seccomp filter (b"B" + program),
the modules to preload (b"P" + newline-separated names) and a scratch path for its rehearsal (b"R" +
path, see `child.rehearse`), and waits for b"ready".
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import socket
import struct
import sys

from tether.sandbox import _enter
from tether.sandbox.child import become_run, rehearse

CLONE_NEWPID = 0x20000000
MAX_RUN_FDS = 16
MAX_INIT_BYTES = 1 << 20
EXIT_REPORT = struct.Struct("=idd")  # wait status, user and system CPU seconds
_ENTRY = "import sys; from tether.sandbox.forkserver import main; main(int(sys.argv[1]))"


def start(
    python_executable: str,
    seccomp_bpf: bytes,
    preload: list[str],
    rehearsal_script: str,
    inherited: list[socket.socket],
    timeout_s: float = 30.0,
) -> socket.socket:
    """Exec the fork server, hand it its filter and preloads, and return its channel once it is ready."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            for sock in (ours, *inherited):
                sock.close()
            os.set_inheritable(theirs.fileno(), True)
            os.execv(python_executable, [python_executable, "-I", "-c", _ENTRY, str(theirs.fileno())])
        finally:
            os._exit(127)
    theirs.close()
    ours.settimeout(timeout_s)
    ours.send(b"B" + seccomp_bpf)
    ours.send(b"P" + "\n".join(preload).encode())
    ours.send(b"R" + rehearsal_script.encode())
    if ours.recv(16) != b"ready":
        raise RuntimeError("the fork server did not start")
    ours.settimeout(None)
    return ours


def _receive(channel: socket.socket, tag: bytes) -> bytes:
    message = channel.recv(MAX_INIT_BYTES)
    if message[:1] != tag:
        raise RuntimeError(f"fork server expected a {tag!r} message")
    return message[1:]


def main(channel_fd: int) -> None:
    channel = socket.socket(fileno=channel_fd)
    _enter.set_process_name("tether-forker")
    seccomp_bpf = _receive(channel, b"B")
    for module in _receive(channel, b"P").decode().split("\n"):
        if module:
            with contextlib.suppress(ImportError):
                importlib.import_module(module)
    rehearse(_receive(channel, b"R").decode())
    # Objects that exist now are never collected, so forked runs do not copy their pages to scan them.
    gc.freeze()
    channel.send(b"ready")
    serve(channel, seccomp_bpf)
    sys.exit(0)


def serve(channel: socket.socket, seccomp_bpf: bytes) -> None:
    """For each request, fork a run as PID 1 of a new PID namespace; answer its pidfd, then its exit."""
    own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    while True:
        _, fds, _, _ = socket.recv_fds(channel, 1, MAX_RUN_FDS)
        if not fds:
            return
        _enter.unshare(CLONE_NEWPID)
        try:
            pid = os.fork()
            if pid == 0:
                plan_fd, *run_fds = fds
                become_run(plan_fd, run_fds, seccomp_bpf)
        finally:
            _enter.setns(own_pid_ns, CLONE_NEWPID)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        socket.send_fds(channel, [b"p"], [pidfd])
        os.close(pidfd)
        _, status, usage = os.wait4(pid, 0)
        channel.send(EXIT_REPORT.pack(status, usage.ru_utime, usage.ru_stime))
