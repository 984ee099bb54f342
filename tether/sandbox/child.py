"""What a freshly forked run process does before the untrusted code starts, and the warm Python runner.

The process arrives here as PID 1 of a new PID namespace (so every process it leaves behind dies with
it), forked by the worker's fork server (`zygote.py`) with its plan in a memfd. It starts a session of
its own (so that `kill(0, ...)` cannot reach the host's process group, which holds every other run),
takes its own mount and IPC namespaces, binds its run directory as the only writable space,
joins its cgroups, drops to the unprivileged run user, locks itself with no_new_privs and seccomp, and
then either execs the program or, for warm Python, runs the script in this already-initialised
interpreter. It never returns: every path ends in exec or `os._exit`.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import resource
import signal
import sys
import threading
import traceback
import types
from dataclasses import dataclass

from tether.sandbox import linux
from tether.sandbox.linux import Clone, Mount

SETUP_FAILED_EXIT = 125
STATUS_FD = 3  # where the setup-status pipe lives once the run's descriptors are rearranged
MAX_FD = 1 << 20


@dataclass(slots=True)
class ChildPlan:
    run_dir: str  # the run's tmpfs under STAGING, holding work/, tmp/, shm/ and meta/
    workdir: str
    argv: list[str]
    inline_python: str | None
    env: dict[str, str]
    uid: int
    gid: int
    cgroup_fds: list[int]
    stdout_fd: int
    stderr_fd: int
    status_fd: int
    seccomp_bpf: bytes
    cpu_time_limit_s: int
    open_files_max: int
    file_size_max_bytes: int


# What crosses to the fork server as data; descriptors travel beside it and the filter is already there.
_DATA_FIELDS = (
    "run_dir",
    "workdir",
    "argv",
    "inline_python",
    "env",
    "uid",
    "gid",
    "cpu_time_limit_s",
    "open_files_max",
    "file_size_max_bytes",
)


def encode_plan(plan: ChildPlan) -> tuple[bytes, list[int]]:
    """The plan as bytes plus the descriptors that must travel with it (by SCM_RIGHTS)."""
    data = json.dumps({name: getattr(plan, name) for name in _DATA_FIELDS}).encode()
    return data, [plan.stdout_fd, plan.stderr_fd, plan.status_fd, *plan.cgroup_fds]


def decode_plan(data: bytes, fds: list[int], seccomp_bpf: bytes) -> ChildPlan:
    stdout_fd, stderr_fd, status_fd, *cgroup_fds = fds
    return ChildPlan(
        **json.loads(data),
        cgroup_fds=cgroup_fds,
        stdout_fd=stdout_fd,
        stderr_fd=stderr_fd,
        status_fd=status_fd,
        seccomp_bpf=seccomp_bpf,
    )


def _enter_run_view(plan: ChildPlan) -> None:
    # The worker's mounts are private already, and binds inherit the run tmpfs's nosuid/nodev.
    linux.unshare(Clone.NEWNS | Clone.NEWIPC)
    for source, target in (("work", plan.workdir), ("tmp", "/tmp"), ("shm", "/dev/shm")):
        linux.mount(f"{plan.run_dir}/{source}", target, None, Mount.BIND)
    linux.mount("proc", "/proc", "proc", Mount.NOSUID | Mount.NODEV | Mount.NOEXEC)


def _lock_down(plan: ChildPlan) -> None:
    # The fork inherits the host's process group, shared by every run of every worker under the same
    # uid: without a session of its own, kill(0, SIGKILL) (kill(getppid()) here) would reach them all.
    os.setsid()
    for fd in plan.cgroup_fds:
        os.write(fd, b"0")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (plan.cpu_time_limit_s, plan.cpu_time_limit_s + 1))
    resource.setrlimit(resource.RLIMIT_NOFILE, (plan.open_files_max, plan.open_files_max))
    resource.setrlimit(resource.RLIMIT_FSIZE, (plan.file_size_max_bytes, plan.file_size_max_bytes))
    # The staging area stays mounted but is closed to the run user (mode 0700, namespace root).
    stdin_fd = os.open(f"{plan.run_dir}/meta/stdin", os.O_RDONLY)
    os.chdir(plan.workdir)
    os.setgroups([])
    os.setresgid(plan.gid, plan.gid, plan.gid)
    os.setresuid(plan.uid, plan.uid, plan.uid)
    linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
    linux.load_seccomp_bpf(plan.seccomp_bpf)
    os.dup2(stdin_fd, 0)
    os.dup2(plan.stdout_fd, 1)
    os.dup2(plan.stderr_fd, 2)
    os.dup2(plan.status_fd, STATUS_FD)
    os.closerange(STATUS_FD + 1, MAX_FD)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def _run_warm_python(script: str, env: dict[str, str]) -> int:
    """Run `script` as `python3 script` would, in the forked interpreter that preloaded the stdlib."""
    os.environ.clear()
    os.environ.update(env)
    atexit._clear()
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8", errors="backslashreplace"
    )
    sys.stderr = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,
    )
    sys.argv = [script]
    sys.path[0:0] = [os.path.dirname(script)]
    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__builtins__ = __builtins__  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    exit_code = 0
    try:
        with open(script, encoding="utf-8") as handle:
            source = handle.read()
        exec(compile(source, script, "exec"), main.__dict__)
    except SystemExit as stop:
        exit_code = _exit_code_of(stop)
    except BaseException as error:
        traceback.print_exception(
            type(error), error, error.__traceback__.tb_next if error.__traceback__ else None
        )
        exit_code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except SystemExit as stop:
        exit_code = _exit_code_of(stop)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            exit_code = exit_code or 120
    return exit_code


def _exit_code_of(stop: SystemExit) -> int:
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code & 0xFF
    print(stop.code, file=sys.stderr)
    return 1


def run_child(plan: ChildPlan) -> None:
    """Turn the freshly forked process into the sandboxed run; never returns."""
    try:
        linux.set_process_name("tether-run")
        _enter_run_view(plan)
        _lock_down(plan)
    except BaseException as error:
        message = f"{type(error).__name__}: {error}".encode()[:4000]
        for fd in (plan.status_fd, STATUS_FD):
            try:
                os.write(fd, message)
                break
            except OSError:
                continue
        os._exit(SETUP_FAILED_EXIT)
    os.close(STATUS_FD)
    if plan.inline_python is not None:
        code = 1
        try:
            code = _run_warm_python(plan.inline_python, plan.env)
        finally:
            os._exit(code)
    try:
        os.execve(plan.argv[0], plan.argv, plan.env)
    except OSError as error:
        os.write(2, f"cannot execute {plan.argv[0]}: {error.strerror}\n".encode())
    os._exit(127)
