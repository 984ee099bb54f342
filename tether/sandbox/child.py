"""What a freshly forked run process does before the untrusted code starts, and the warm Python runner.

Imported by the fork server, whose every page each run copies on write: it imports nothing heavy.

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
import types

from tether.sandbox import _enter

SETUP_FAILED_EXIT = 125
STATUS_FD = 3  # where `_enter.enter` leaves the setup-status pipe for the warm-Python path
# The signals a run starts with at their default action, as under a plain shell (an exec'd program
# too: it inherits the fork server's dispositions, where Python's start-up ignores SIGPIPE).
RUN_SIGNAL_DEFAULTS = (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE, signal.SIGHUP)


def become_run(plan_fd: int, run_fds: list[int], seccomp_bpf: bytes) -> None:
    """Turn this freshly forked process into the sandboxed run; never returns."""
    try:
        # The environment is empty and RUN_SIGNAL_DEFAULTS are at SIG_DFL, in the kernel and in Python's
        # table alike: the fork server set both before its first fork (`forkserver.settle_for_runs`).
        script, environment = _enter.enter(plan_fd, tuple(run_fds), seccomp_bpf)
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
    # The fork skipped Python's at-fork handlers (see `_enter.serve_forks`): seeded afresh here, as
    # `python3 script` would be, no two runs share a random sequence.
    random_module = sys.modules.get("random")
    if random_module is not None:
        random_module.seed()
    code = 1
    try:
        code = _run_warm_python(script, dict(entry.split("=", 1) for entry in environment))
    finally:
        os._exit(code)


def _run_warm_python(script: str, env: dict[str, str], finalize: bool = True) -> int:
    """Run `script` as `python3 script` would, in the forked interpreter that preloaded the stdlib.

    `finalize=False` skips the interpreter's shutdown steps (joining threads, atexit), for a rehearsal
    in the fork server itself, which must go on living.
    """
    os.environ.clear()
    os.environ.update(env)
    if finalize:
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
    # The working directory, which is the script's own except in a session (its programs live outside).
    sys.path[0:0] = [os.getcwd()]
    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__builtins__ = __builtins__  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    exit_code = 0
    try:
        with open(script, "rb") as handle:  # bytes: compile() honours a coding declaration, as python does
            source = handle.read()
        exec(compile(source, script, "exec"), main.__dict__)
    except SystemExit as stop:
        exit_code = _exit_code_of(stop)
    except BaseException as error:
        # The interpreter's own printer, as `python3 script` would use, minus this runner's frame.
        sys.__excepthook__(type(error), error, error.__traceback__.tb_next if error.__traceback__ else None)
        exit_code = 1
    if finalize:
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


REHEARSALS = (
    "import sys\nprint(sum(range(1000)))\nprint('note', file=sys.stderr)\nsys.stdin.read()\n",
    "from typing import List\nimport math\n\n\ndef f(xs: List[int]) -> int:\n"
    "    return sum(math.isqrt(x) for x in xs)\n\n\nassert f([1, 4, 9]) == 6\nprint({'k': [f([16])]})\n",
    "def check(x):\n    assert x == 1, 'no'\ncheck(2)\n",
    "import sys\nsys.exit(3)\n",
)


def rehearse(script: str, rounds: int = 10) -> None:
    """Run small programs through the warm runner here, then undo what they changed.

    A forked run that finds Python's caches cold (attribute lookups, specialised bytecode) fills them at
    the price of a copy-on-write fault for every page it writes, on every run; filling them once in the
    fork server spares each run that. `script` is a writable path for the programs (removed afterwards);
    their standard streams go to /dev/null.
    """
    saved_streams = (sys.stdin, sys.stdout, sys.stderr)
    saved_argv, saved_path, saved_main = list(sys.argv), list(sys.path), sys.modules.get("__main__")
    saved_environ = dict(os.environ)
    saved_fds = [os.dup(fd) for fd in (0, 1, 2)]
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        for _ in range(rounds):
            for program in REHEARSALS:
                with open(script, "w", encoding="utf-8") as handle:
                    handle.write(program)
                _run_warm_python(script, {"PATH": "/usr/bin:/bin"}, finalize=False)
    finally:
        for fd, saved in zip((0, 1, 2), saved_fds, strict=True):
            os.dup2(saved, fd)
            os.close(saved)
        os.close(null)
        os.remove(script)
        sys.stdin, sys.stdout, sys.stderr = saved_streams
        sys.argv, sys.path[:] = saved_argv, saved_path
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
        os.environ.clear()
        os.environ.update(saved_environ)


def _exit_code_of(stop: SystemExit) -> int:
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code & 0xFF
    print(stop.code, file=sys.stderr)
    return 1
