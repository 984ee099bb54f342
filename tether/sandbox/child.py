"""What a freshly forked run process does before the untrusted code starts, and the warm Python runner.

The process arrives here as PID 1 of a new PID namespace (so every process it leaves behind dies with
it), forked by the worker's fork server (`zygote.py`) with its plan in a memfd. The isolation steps
themselves are plain system calls in `_enter.c` (a forked interpreter pays a copy-on-write fault for
every page Python touches): its own session (so `kill(0, ...)` cannot reach the host's process group,
which holds every other run), its own mount and IPC namespaces, its run directory as the only writable
space, its cgroups, the unprivileged run user, no_new_privs and seccomp. Then it either execs the
program or, for warm Python, runs the script in this already-initialised interpreter. It never
returns: every path ends in exec or `os._exit`.
"""

from __future__ import annotations

import atexit
import io
import os
import signal
import sys
import threading
import traceback
import types
from dataclasses import dataclass, field

from tether.sandbox import _enter

SETUP_FAILED_EXIT = 125
STATUS_FD = 3  # where `_enter.enter` leaves the setup-status pipe for the warm-Python path


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
    cpu_time_limit_s: int
    open_files_max: int
    file_size_max_bytes: int
    shadows: list[tuple[str, str]] = field(default_factory=list)  # (alias in the root view, path to re-bind)


def encode_plan(plan: ChildPlan) -> tuple[bytes, list[int]]:
    """The plan in `_enter.c`'s format (NUL-terminated fields), and the descriptors that travel beside it."""
    fields = [
        plan.run_dir,
        plan.workdir,
        str(plan.uid),
        str(plan.gid),
        str(plan.cpu_time_limit_s),
        str(plan.open_files_max),
        str(plan.file_size_max_bytes),
        "python" if plan.inline_python is not None else "exec",
        str(len(plan.argv)),
        *plan.argv,
        str(len(plan.env)),
        *(f"{key}={value}" for key, value in plan.env.items()),
        str(2 * len(plan.shadows)),
        *(path for pair in plan.shadows for path in pair),
    ]
    if plan.inline_python is not None:
        fields.append(plan.inline_python)
    if any("\0" in item for item in fields):
        raise ValueError("a run's arguments, environment and paths cannot contain NUL characters")
    data = b"".join(item.encode() + b"\0" for item in fields)
    return data, [plan.stdout_fd, plan.stderr_fd, plan.status_fd, *plan.cgroup_fds]


def become_run(plan_fd: int, run_fds: list[int], seccomp_bpf: bytes) -> None:
    """Turn this freshly forked process into the sandboxed run; never returns."""
    try:
        script, environment = _enter.enter(plan_fd, tuple(run_fds), seccomp_bpf)
        # The kernel's dispositions were reset by `enter`; Python's own table must agree with them.
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
    except BaseException as error:
        message = f"{type(error).__name__}: {error}".encode()[:4000]
        for fd in (run_fds[2] if len(run_fds) > 2 else -1, STATUS_FD):
            try:
                os.write(fd, message)
                break
            except OSError:
                continue
        os._exit(SETUP_FAILED_EXIT)
    os.close(STATUS_FD)
    code = 1
    try:
        code = _run_warm_python(script, dict(entry.split("=", 1) for entry in environment))
    finally:
        os._exit(code)


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
