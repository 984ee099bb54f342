"""The fork server: the warm interpreter every run of a worker is forked from.

It is a fresh interpreter, exec'd by the zygote once its root view is built, not a fork of the zygote:
so it holds no remnant of any run (a warm Python run can read all the memory it inherits), and none
of the zygote's modules either (each mapping and page it carries costs every run at fork and exit).
It imports the preloaded modules, then, per request, forks a run as PID 1 of a new PID namespace,
answers the run's pidfd, and, once the run has exited, its wait status and CPU time (the run reaps
every descendant into its own rusage). That loop is C (`_enter.serve_forks`): it runs no Python
between forks and skips Python's at-fork handlers, whose page writes every run would copy. It only
ever receives descriptors: the plan is a memfd that the forked child reads itself, so nothing a run
sends or prints reaches this process's memory.

Started as `python -I -c "..." PACKAGE_ROOT CHANNEL_FD`; the zygote then sends the seccomp filter
(b"B" + program), the modules to preload (b"P" + newline-separated names) and a scratch path for its
rehearsal (b"R" + path, see `child.rehearse`), and waits for b"ready".
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import signal
import socket
import struct
import sys
import threading

from tether.sandbox import _enter
from tether.sandbox.child import RUN_SIGNAL_DEFAULTS, become_run, rehearse

MAX_INIT_BYTES = 1 << 20
EXIT_REPORT = struct.Struct("=idd")  # wait status, user and system CPU seconds
# The folder holding this `tether` package, first on the server's path: the server runs the very code
# the zygote runs, not whichever `tether` the interpreter's site would find (an editable install).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ENTRY = (
    "import sys; sys.path.insert(0, sys.argv[1]); from tether.sandbox.forkserver import main; "
    "main(int(sys.argv[2]))"
)


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
            argv = [python_executable, "-I", "-c", _ENTRY, PACKAGE_ROOT, str(theirs.fileno())]
            os.execv(python_executable, argv)
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
    settle_for_runs()
    # Objects that exist now are never collected, so forked runs do not copy their pages to scan them.
    gc.freeze()
    channel.send(b"ready")
    serve(channel, seccomp_bpf)
    sys.exit(0)


def settle_for_runs() -> None:
    """Put this process in the state each run starts from, once, rather than in every run.

    A run inherits it through fork; redoing it there (clearing `os.environ` key by key, five
    `signal.signal` calls) costs a copy-on-write fault for each page it writes, on every run. The
    server itself has no use for its environment (it execs nothing), and SIGPIPE at its default is
    safe here: the C loop sends with MSG_NOSIGNAL.
    """
    os.environ.clear()
    for signum in RUN_SIGNAL_DEFAULTS:
        signal.signal(signum, signal.SIG_DFL)


def serve(channel: socket.socket, seccomp_bpf: bytes) -> None:
    """For each request, fork a run as PID 1 of a new PID namespace; answer its pidfd, then its exit.

    The loop is `_enter.serve_forks`, in C: it returns here only in a forked run (with the request's
    descriptors) or once the channel closes (None).
    """
    assert threading.active_count() == 1, "the fork server forks without at-fork handlers: one thread only"
    own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    run_fds = _enter.serve_forks(channel.fileno(), own_pid_ns)
    if run_fds is None:
        return
    plan_fd, *fds = run_fds
    become_run(plan_fd, fds, seccomp_bpf)
