"""The fork server: the process every run of a worker is forked from, kept free of any run's data.

The zygote's heap keeps remnants of every run it served (code, stdin, files, output), and a warm Python
run can read all the memory it inherits; so runs fork from this copy of the zygote, taken before the
first request. It only ever receives descriptors: the plan is a memfd read by the forked child, never
here. It forks each run as PID 1 of a new PID namespace, answers the run's pidfd, and, once the run
has exited, its wait status and CPU time (the run reaps every descendant into its own rusage).
"""

from __future__ import annotations

import os
import socket
import struct

from tether.sandbox import linux
from tether.sandbox.child import become_run
from tether.sandbox.linux import Clone

MAX_RUN_FDS = 16
EXIT_REPORT = struct.Struct("=idd")  # wait status, user and system CPU seconds


def start(seccomp_bpf: bytes, inherited: list[socket.socket]) -> socket.socket:
    """Fork the process runs are forked from, now, while this heap holds nothing of any run."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            for sock in (ours, *inherited):
                sock.close()
            linux.set_process_name("tether-forker")
            serve(theirs, seccomp_bpf)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    theirs.close()
    return ours


def serve(channel: socket.socket, seccomp_bpf: bytes) -> None:
    """For each request, fork a run as PID 1 of a new PID namespace; answer its pidfd, then its exit.

    A request is one byte carrying descriptors: the plan's memfd, then the run's own. The plan is read
    by the forked child, never here, so nothing a run sends or prints reaches this process's memory.
    """
    own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    while True:
        _, fds, _, _ = socket.recv_fds(channel, 1, MAX_RUN_FDS)
        if not fds:
            return
        linux.unshare(Clone.NEWPID)
        try:
            pid = os.fork()
            if pid == 0:
                plan_fd, *run_fds = fds
                become_run(plan_fd, run_fds, seccomp_bpf)
        finally:
            linux.setns(own_pid_ns, Clone.NEWPID)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        socket.send_fds(channel, [b"p"], [pidfd])
        os.close(pidfd)
        _, status, usage = os.wait4(pid, 0)
        channel.send(EXIT_REPORT.pack(status, usage.ru_utime, usage.ru_stime))
