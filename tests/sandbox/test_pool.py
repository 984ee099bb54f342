"""SandboxPool behaviour on the real kernel: languages, statuses, limits, files, QC and recovery."""

from __future__ import annotations

import ast
import asyncio
import base64
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tether.errors import ConfigError
from tether.sandbox import PoolConfig, RunStatus, SandboxPool, SandboxSpec, forkserver
from tether.sandbox.cgroups import CgroupStats, RunCgroup
from tether.sandbox.protocol import StepOutcome
from tether.sandbox.result import classify
from tether.sandbox.worker import remove_stale_skeletons

HELLO = {
    "python": "print('hello', 6 * 7)",
    "bash": "echo hello $((6 * 7))",
    "c": '#include <stdio.h>\nint main(void) { printf("hello %d\\n", 6 * 7); return 0; }',
    "cpp": '#include <iostream>\nint main() { std::cout << "hello " << 6 * 7 << std::endl; }',
    "javascript": "console.log('hello', 6 * 7)",
}


@pytest.mark.parametrize("language", sorted(HELLO))
async def test_every_language_runs(pool: SandboxPool, language: str) -> None:
    result = await pool.run(HELLO[language], language=language)
    assert result.status is RunStatus.OK, result
    assert result.stdout == "hello 42\n"
    assert result.exit_code == 0
    assert result.qc == "passed"
    assert result.wall_ms > 0 and result.cpu_ms > 0 and result.peak_memory_kib > 0


@pytest.mark.parametrize(("language", "code"), [("c", "int main( {"), ("cpp", "int main() { undefined(); }")])
async def test_compile_errors_have_their_own_status(pool: SandboxPool, language: str, code: str) -> None:
    result = await pool.run(code, language=language)
    assert result.status is RunStatus.COMPILE_ERROR
    assert result.compile is not None and result.compile.exit_code != 0
    assert "error" in result.compile.stderr


async def test_stdin_reaches_the_program(pool: SandboxPool) -> None:
    result = await pool.run(
        "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", stdin="1 2 3\n"
    )
    assert result.stdout == "6\n"


async def test_files_are_uploaded_and_collected(pool: SandboxPool) -> None:
    code = "data = open('in/data.txt').read()\nopen('out.bin', 'wb').write(data.upper().encode())"
    result = await pool.run(code, files={"in/data.txt": "abc"}, collect=["out.bin", "absent.txt"])
    assert result.status is RunStatus.OK, result
    assert base64.b64decode(result.files["out.bin"]) == b"ABC"
    assert result.missing_files == ["absent.txt"]


@pytest.mark.parametrize(
    ("code", "exit_code", "stderr_part"),
    [
        ("raise ValueError('boom')", 1, "ValueError: boom"),
        ("import sys\nsys.exit(3)", 3, ""),
        ("import sys\nsys.exit('bye')", 1, "bye"),
        ("def f(): return f()\nf()", 1, "RecursionError"),
    ],
)
@pytest.mark.parametrize("warm", [True, False])
async def test_python_failures_match_a_real_interpreter(
    pool: SandboxPool, code: str, exit_code: int, stderr_part: str, warm: bool
) -> None:
    result = await pool.run(code, warm=warm)
    assert result.status is RunStatus.RUNTIME_ERROR
    assert result.exit_code == exit_code
    assert stderr_part in result.stderr


async def test_warm_python_runs_as_main_with_a_fresh_namespace(pool: SandboxPool) -> None:
    first = await pool.run("import sys\nsys.modules['json'].LEAK = 1\nX = 5\nprint(__name__)")
    second = await pool.run("import json\nprint(hasattr(json, 'LEAK'), 'X' in globals(), __file__)")
    assert first.stdout == "__main__\n"
    assert second.stdout == "False False /workspace/main.py\n"


async def test_each_warm_run_gets_its_own_random_sequence(pool: SandboxPool) -> None:
    # The fork server forks without Python's at-fork handlers, random's reseed among them: the run
    # must still be seeded afresh, as `python3 script` would be, not replay the server's sequence.
    code = "import random\nprint(random.getrandbits(64))"
    results = [await pool.run(code) for _ in range(4)]
    assert all(r.status is RunStatus.OK for r in results), results
    assert len({r.stdout for r in results}) == 4


async def test_a_warm_run_starts_with_its_own_environment_and_default_signals(pool: SandboxPool) -> None:
    # The fork server clears its environment and resets these signals once, before its first fork
    # (`forkserver.settle_for_runs`), instead of in every run: each run must still start that way.
    code = (
        "import os, signal\n"
        "names = ('SIGINT', 'SIGTERM', 'SIGCHLD', 'SIGPIPE', 'SIGHUP')\n"
        "print(sorted(os.environ))\n"
        "print([n for n in names if signal.getsignal(getattr(signal, n)) is not signal.SIG_DFL])"
    )
    fresh = await pool.run("import os\nprint(sorted(os.environ))", warm=False)
    for _ in range(2):
        warm = await pool.run(code, spec=SandboxSpec(timeout_s=10, env={"ONLY_THIS_RUN": "1"}))
        assert warm.status is RunStatus.OK, warm
        environ, not_default = warm.stdout.splitlines()
        assert environ == str(sorted([*ast.literal_eval(fresh.stdout), "ONLY_THIS_RUN"]))
        assert not_default == "[]"
    assert "ONLY_THIS_RUN" not in (await pool.run("import os\nprint(sorted(os.environ))")).stdout


async def test_an_exec_run_starts_with_sigpipe_at_its_default(pool: SandboxPool) -> None:
    # As under a plain shell: the writer of a closed pipe dies of SIGPIPE (128 + 13), it does not
    # inherit the fork server's Python-startup SIG_IGN and fail on EPIPE.
    result = await pool.run('yes | head -n 1; echo "${PIPESTATUS[0]}"', language="bash")
    assert result.status is RunStatus.OK, result
    assert result.stdout == "y\n141\n"


async def test_runs_fork_from_the_package_the_host_runs(pool: SandboxPool) -> None:
    # The fork server must import this very checkout, not whichever `tether` its site finds first
    # (an editable install of another checkout): runs execute its code.
    code = "import sys\nprint(sys.modules['tether.sandbox.forkserver'].__file__)"
    result = await pool.run(code)
    assert result.status is RunStatus.OK, result
    assert result.stdout.strip() == forkserver.__file__


async def test_a_warm_run_sees_one_consistent_main_thread(pool: SandboxPool) -> None:
    # Forked without threading's at-fork handler: the run's thread table must still name it the main
    # thread, and a thread it starts must run and be joined at exit.
    code = (
        "import threading\n"
        "assert threading.current_thread() is threading.main_thread()\n"
        "assert threading.main_thread().ident == threading.get_ident()\n"
        "done = []\n"
        "worker = threading.Thread(target=lambda: done.append(threading.active_count()))\n"
        "worker.start(); worker.join()\n"
        "print(done, threading.active_count())"
    )
    for _ in range(2):
        result = await pool.run(code)
        assert result.status is RunStatus.OK, result
        assert result.stdout == "[2] 1\n"


async def test_crash_by_signal_is_a_runtime_error(pool: SandboxPool) -> None:
    result = await pool.run("int main(void) { volatile int *p = 0; return *p; }", language="c")
    assert result.status is RunStatus.RUNTIME_ERROR
    assert result.signal == signal.SIGSEGV


async def test_timeout_stops_the_run_at_the_limit(pool: SandboxPool) -> None:
    result = await pool.run(
        "import time\nprint('start', flush=True)\ntime.sleep(60)", spec=SandboxSpec(timeout_s=1)
    )
    assert result.status is RunStatus.TIMEOUT
    assert result.stdout == "start\n"
    assert 900 <= result.wall_ms < 5000


async def test_memory_limit_is_classified_from_the_oom_counter(pool: SandboxPool) -> None:
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(8 << 20))"
    result = await pool.run(code, spec=SandboxSpec(memory_mib=64))
    assert result.status is RunStatus.MEMORY_LIMIT
    assert result.peak_memory_kib >= 60 * 1024


async def test_output_limit_truncates_and_flags(pool: SandboxPool) -> None:
    result = await pool.run("while True:\n    print('x' * 1000)", spec=SandboxSpec(output_limit_kib=16))
    assert result.status is RunStatus.OUTPUT_LIMIT
    assert result.stdout_truncated
    assert len(result.stdout) == 16 * 1024


async def test_unknown_language_names_the_accepted_ones(pool: SandboxPool) -> None:
    with pytest.raises(ConfigError, match="language 'cobol' is not supported; accepted: bash, c, cpp"):
        await pool.run("DISPLAY 'x'", language="cobol")


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"code": "print('\ud800')"}, "code"),
        ({"code": "print(1)", "stdin": "\udfff"}, "stdin"),
        ({"code": "print(1)", "files": {"a.txt": "x\ud83d"}}, "files['a.txt']"),
        ({"code": "print(1)", "files": {"\ud800.txt": "x"}}, "files"),
        ({"code": "print(1)", "collect": ["\ud800"]}, "collect"),
    ],
    ids=["code", "stdin", "file-content", "file-name", "collect"],
)
async def test_text_with_a_lone_surrogate_is_refused_naming_the_field(
    pool: SandboxPool, arguments: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        await pool.run(**arguments)
    assert str(refused.value).startswith(f"{field} = ") and "lone UTF-16 surrogate" in str(refused.value)
    assert pool.busy_slots == 0 and pool.workers_replaced == 0


async def test_runs_are_concurrent_up_to_the_slots(pool: SandboxPool) -> None:
    started = asyncio.get_running_loop().time()
    results = await asyncio.gather(*(pool.run("import time\ntime.sleep(0.5)") for _ in range(2)))
    elapsed = asyncio.get_running_loop().time() - started
    assert all(r.status is RunStatus.OK for r in results)
    assert elapsed < 0.95


async def test_a_failed_quality_check_discards_the_worker(pool: SandboxPool) -> None:
    victim = pool._idle[-1]
    victim.baseline_fingerprint = "tampered"
    result = await pool.run("print(1)")
    assert result.qc == "failed"
    assert "fingerprint" in result.qc_detail[0]
    await asyncio.sleep(0.5)
    assert pool.workers_replaced == 1
    assert victim not in pool._idle
    after = await asyncio.gather(*(pool.run("print(2)") for _ in range(4)))
    assert all(r.status is RunStatus.OK and r.qc == "passed" for r in after)


async def test_a_dead_worker_is_reported_and_replaced(pool: SandboxPool) -> None:
    victim = pool._idle[-1]
    assert victim.process is not None
    os.kill(victim.process.pid, signal.SIGKILL)
    await victim.process.wait()
    result = await pool.run("print(1)")
    assert result.status is RunStatus.SANDBOX_ERROR
    assert result.qc == "failed"
    await asyncio.sleep(0.5)
    assert (await pool.run("print(3)")).stdout == "3\n"


async def test_pool_refuses_bad_config() -> None:
    with pytest.raises(ConfigError, match="slots = 0"):
        PoolConfig(slots=0)
    with pytest.raises(ConfigError, match="host_uid_base = 0"):
        PoolConfig(host_uid_base=0)
    with pytest.raises(ConfigError, match="session_wait_s = 0: must be positive"):
        PoolConfig(session_wait_s=0)
    for workdir in ("work", "/", "/tmp", "/tmp/work", "/mnt/data", "/dev", "/.program", "/.staging/x", "//"):
        with pytest.raises(ConfigError, match=f"workdir = {workdir!r}: must be an absolute path"):
            PoolConfig(workdir=workdir)
    assert PoolConfig(workdir="/home/sandbox").workdir == "/home/sandbox"


def _outcome(**changes: object) -> StepOutcome:
    fields: dict[str, object] = {
        "exit_code": 0,
        "signal": None,
        "timed_out": False,
        "output_exceeded": False,
        "stdout_b64": "",
        "stderr_b64": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "wall_ms": 1.0,
    }
    fields.update(changes)
    return StepOutcome(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("outcome", "oom_kills", "expected"),
    [
        (_outcome(), 0, RunStatus.OK),
        (_outcome(exit_code=2), 0, RunStatus.RUNTIME_ERROR),
        (_outcome(exit_code=None, signal=signal.SIGKILL), 1, RunStatus.MEMORY_LIMIT),
        (_outcome(exit_code=0), 1, RunStatus.MEMORY_LIMIT),
        (_outcome(exit_code=None, signal=signal.SIGKILL, timed_out=True), 0, RunStatus.TIMEOUT),
        (_outcome(exit_code=None, signal=signal.SIGXCPU), 0, RunStatus.TIMEOUT),
        (_outcome(exit_code=None, signal=signal.SIGKILL, output_exceeded=True), 0, RunStatus.OUTPUT_LIMIT),
        (_outcome(exit_code=None, signal=signal.SIGKILL), 0, RunStatus.KILLED),
        (_outcome(exit_code=None, signal=signal.SIGSEGV), 0, RunStatus.RUNTIME_ERROR),
        (_outcome(exit_code=125, setup_error="mount: EPERM"), 0, RunStatus.SANDBOX_ERROR),
    ],
)
def test_classification_rules(outcome: StepOutcome, oom_kills: int, expected: RunStatus) -> None:
    assert classify(outcome, CgroupStats(100, oom_kills)) is expected


def test_failed_compile_is_a_compile_error() -> None:
    assert classify(_outcome(exit_code=1), CgroupStats(1, 0), is_compile=True) is RunStatus.COMPILE_ERROR


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../x", "", "bad\0name"])
async def test_paths_outside_the_workdir_are_refused_before_a_slot_is_taken(
    pool: SandboxPool, path: str
) -> None:
    with pytest.raises(ConfigError, match="must be relative to the working directory"):
        await pool.run("print(1)", files={path: "x"})
    with pytest.raises(ConfigError, match="must be relative to the working directory"):
        await pool.run("print(1)", collect=[path])
    assert pool.busy_slots == 0 and pool.workers_replaced == 0


async def test_cpu_time_counts_every_process_of_the_run(pool: SandboxPool) -> None:
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    code = f"python3 -c '{burn}' &\npython3 -c '{burn}' &\nwait"
    result = await pool.run(code, language="bash", spec=SandboxSpec(cpu_limit=2))
    assert result.status is RunStatus.OK, result
    assert result.cpu_ms >= 550


def test_stale_mount_points_of_dead_hosts_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead_pid = 4_000_000  # above pid_max: never a live process
    stale = tmp_path / f"tether-root-{dead_pid}-abc"
    live = tmp_path / f"tether-root-{os.getpid()}-def"
    stale.mkdir()
    live.mkdir()
    assert remove_stale_skeletons() == 1
    assert not stale.exists() and live.exists()


async def test_cgroup_failure_is_a_sandbox_error_and_keeps_the_worker(
    pool: SandboxPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_room(self: RunCgroup, limits: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(RunCgroup, "create", no_room)
    result = await pool.run("print(1)")
    assert result.status is RunStatus.SANDBOX_ERROR
    assert result.error is not None and "cannot create the run's cgroups" in result.error
    monkeypatch.undo()
    assert (await pool.run("print(2)")).stdout == "2\n"
    assert pool.workers_replaced == 0


async def test_two_pools_in_one_process_run_side_by_side() -> None:
    async with (
        SandboxPool(SandboxSpec(timeout_s=5), PoolConfig(slots=1)) as first,
        SandboxPool(SandboxSpec(timeout_s=5), PoolConfig(slots=1)) as second,
    ):
        results = await asyncio.gather(*(p.run("print(7)") for p in (first, second) for _ in range(3)))
    assert all(r.status is RunStatus.OK and r.qc == "passed" for r in results)


@pytest.mark.parametrize("warm", [True, False])
async def test_a_failed_setup_step_reaches_the_host_by_its_status_pipe(pool: SandboxPool, warm: bool) -> None:
    # The zygote reads the status pipe only once the run has exited: its message must still arrive.
    # No spec asks for this many descriptors (the kernel caps RLIMIT_NOFILE below it), so `enter` fails.
    request, compiled = pool.build_request("print('NEVER_RUN')", "python", "", {}, pool.spec, warm)
    request.steps[-1].open_files_max = 1 << 40
    worker = pool._idle.pop()
    try:
        result, healthy = await pool.execute(worker, request, pool.spec, compiled)
    finally:
        pool._idle.append(worker)
    assert healthy
    assert result.status is RunStatus.SANDBOX_ERROR, result
    assert result.error is not None and result.error.startswith("RLIMIT_NOFILE: "), result.error
    assert "NEVER_RUN" not in result.stdout
    assert (await pool.run("print(3)")).stdout == "3\n"
