"""Escape attempts against the real sandbox, each checked from the host as well as by the run's result.

Every attack program prints a marker for each thing it tried (BLOCKED, FORK_LIMITED, ...) and would
print LEAKED had one got through, so no test passes because an attack silently did nothing. The host
then checks what a compromised sandbox could lie about: its own processes (by scanning /proc for the
sandbox's host uids), its listening sockets, its files and disk. Pools here use a host uid range of
their own, so a sandbox suite running beside this one cannot be mistaken for a survivor.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import sys
import sysconfig
import textwrap
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tether.errors import ConfigError, TetherError
from tether.sandbox import PoolConfig, QcStatus, RunResult, RunStatus, SandboxPool, SandboxSpec
from tether.sandbox.pool import SandboxUnavailable

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0, reason="the sandbox needs Linux and root"
)

UID_BASE = 3_000_000 + (os.getpid() % 2048) * 65_536  # this process's own range (see module docstring)
RUN_UID = 1000
TOKEN = secrets.token_hex(6)  # names every file an attack tries to create outside its sandbox
ESCAPE_NAME = f"tether-escape-{TOKEN}"
TIGHT: dict[str, Any] = {
    "timeout_s": 2.0,
    "compile_timeout_s": 20.0,
    "memory_mib": 96,
    "pids_max": 32,
    "disk_mib": 8,
    "output_limit_kib": 64,
}
C_SPEC: dict[str, Any] = {"memory_mib": 160}  # room for cc1 and ld in the compile step
FAILED = (RunStatus.TIMEOUT, RunStatus.MEMORY_LIMIT, RunStatus.RUNTIME_ERROR, RunStatus.KILLED)
EPERM, ENOSYS = errno.EPERM, errno.ENOSYS


# ---------------------------------------------------------------- host-side observation


def sandbox_processes() -> dict[int, int]:
    """pid -> real host uid of every live process in this module's sandbox uid range, from /proc.

    Zombies are left out: they have exited, and a discarded worker's zygote may wait a while for the
    host's init to reap it.
    """
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as status:
                fields = dict(line.split(":", 1) for line in status if line.startswith(("State:", "Uid:")))
        except (OSError, ValueError):
            continue
        if "Uid" not in fields or fields.get("State", "").split()[:1] == ["Z"]:
            continue
        uid = int(fields["Uid"].split()[0])
        if UID_BASE <= uid < UID_BASE + 65_536:
            found[int(entry.name)] = uid
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def covered_tmp_entries(pool: SandboxPool) -> list[str]:
    """What a run's fresh /tmp holds: only the read-only re-binds of allowed paths under /tmp (a checkout)."""
    return sorted({path.split("/")[2] for path in pool.config.readonly_paths() if path.startswith("/tmp/")})


def host_escape_files(extra_roots: tuple[str, ...] = ()) -> list[str]:
    """Files named after ESCAPE_NAME anywhere an attack could have reached, two levels below each root."""
    python_paths = (
        sys.prefix,
        sys.base_prefix,
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["stdlib"],
    )
    hits = []
    for root in dict.fromkeys(("/", "/usr", "/etc", "/root", "/dev", *python_paths, *extra_roots)):
        for directory, subdirectories, files in os.walk(root):
            depth = directory.rstrip("/").count("/") - root.rstrip("/").count("/")
            if depth >= 2 or directory.startswith(("/proc", "/sys")):
                subdirectories.clear()
            hits += [f"{directory}/{name}" for name in files + subdirectories if name.startswith(ESCAPE_NAME)]
    return hits


def host_state() -> dict[str, object]:
    """Host settings and files the attacks try to change; every attack must leave them as they were."""
    state: dict[str, object] = {}
    for knob in ("kernel/hostname", "kernel/domainname", "kernel/core_pattern"):
        state[knob] = Path(f"/proc/sys/{knob}").read_text()
    for path in ("/etc/passwd", "/etc/hosts", "/usr/bin", "/usr/bin/env", sys.executable):
        info = os.stat(path)
        state[path] = (info.st_mode, info.st_uid, info.st_gid, info.st_size, info.st_mtime_ns)
    return state


def host_ipv4_addresses() -> list[str]:
    """Every local IPv4 address of the host, from the kernel's FIB (no tools needed)."""
    addresses, last = set(), None
    for line in Path("/proc/net/fib_trie").read_text().splitlines():
        text = line.strip()
        if text.startswith("|--"):
            last = text.split()[1]
        elif text.startswith("/32 host LOCAL") and last:
            addresses.add(last)
    return sorted(addresses)


def describe(result: RunResult) -> str:
    compiler = f"--- compiler\n{result.compile.stderr[-2000:]}\n" if result.compile else ""
    return (
        f"status={result.status} exit={result.exit_code} signal={result.signal} qc={result.qc} "
        f"{result.qc_detail} error={result.error}\n{compiler}--- stdout\n{result.stdout[:3000]}\n"
        f"--- stderr\n{result.stderr[-3000:]}"
    )


def program(template: str, **values: object) -> str:
    """Dedent an attack program and fill its @NAME@ slots (C and JSON braces stay untouched)."""
    text = textwrap.dedent(template)
    for name, value in values.items():
        text = text.replace(f"@{name}@", str(value))
    assert not re.search(r"@[A-Z_]+@", text), f"unfilled slot in {text[:300]}"
    return text


# Prints every PREFIX + 16-hex-digit token in this process's anonymous memory, raw or base64-encoded
# (as they travel in the worker protocol). The program holds only the prefix, never a token it seeks.
HEAP_SCAN = """
def heap_tokens(prefix):
    import base64, ctypes, re
    assert len(prefix) % 3 == 0
    plain = re.compile(re.escape(prefix) + rb"[0-9a-f]{16}")
    encoded = re.compile(re.escape(base64.b64encode(prefix)) + rb"[A-Za-z0-9+/]{20}")
    found = set()
    with open("/proc/self/maps") as maps:
        regions = [line.split() for line in maps]
    for fields in regions:
        if not fields[1].startswith("r") or (len(fields) > 5 and fields[5] not in ("[heap]", "[stack]")):
            continue
        low, high = (int(x, 16) for x in fields[0].split("-"))
        data = ctypes.string_at(low, high - low)
        found.update(match.decode() for match in plain.findall(data))
        found.update(base64.b64decode(match).decode() for match in encoded.findall(data))
    return found
"""


def sandbox_spec(**overrides: Any) -> SandboxSpec:
    return SandboxSpec(**{**TIGHT, **overrides})


@dataclass
class Sandbox:
    """A real pool with the host-side checks every attack ends with."""

    pool: SandboxPool
    workers: int  # sandbox-uid processes of the idle workers, counted right after start

    async def run(self, code: str, language: str = "python", **kwargs: Any) -> RunResult:
        result = await self.pool.run(code, language=language, **kwargs)
        assert result.qc is QcStatus.PASSED, describe(result)
        await self.assert_host_clean()
        return result

    async def assert_host_clean(self) -> None:
        """No run process is left on the host, and the workers are as many as when the pool started."""
        survivors = {pid: uid for pid, uid in sandbox_processes().items() if uid != UID_BASE}
        assert not survivors, {pid: command_line(pid) for pid in survivors}
        deadline = time.monotonic() + 5
        while (count := len(sandbox_processes())) != self.workers:
            assert time.monotonic() < deadline, (
                f"{count} worker processes on the host, expected {self.workers}"
            )
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def open_sandbox(slots: int = 1, **spec: Any) -> AsyncIterator[Sandbox]:
    pool = SandboxPool(sandbox_spec(**spec), PoolConfig(slots=slots, host_uid_base=UID_BASE))
    try:
        await pool.start()
    except SandboxUnavailable as error:
        pytest.skip(f"sandbox unavailable here: {error}")
    try:
        await pool.warmed()  # `start` returns with the first worker up: count them all
        yield Sandbox(pool, len(sandbox_processes()))
    finally:
        await pool.close()
    deadline = time.monotonic() + 5
    while left := sandbox_processes():
        assert time.monotonic() < deadline, {pid: command_line(pid) for pid in left}
        await asyncio.sleep(0.02)


@contextlib.contextmanager
def process_sampler(interval_s: float = 0.05) -> Iterator[list[int]]:
    """Sample, from the host, how many run processes exist while the block runs; yields the samples."""
    samples: list[int] = []

    async def sample() -> None:
        while True:
            samples.append(sum(1 for uid in sandbox_processes().values() if uid != UID_BASE))
            await asyncio.sleep(interval_s)

    task = asyncio.get_running_loop().create_task(sample())
    try:
        yield samples
    finally:
        task.cancel()


# ---------------------------------------------------------------- self-contained attacks


def blocked(labels: str, code: int = EPERM) -> tuple[str, ...]:
    """The markers `report`/`attempt` print for each refused call in `labels` (space-separated)."""
    return tuple(f"BLOCKED {label} errno={code}" for label in labels.split())


@dataclass(frozen=True)
class Attack:
    id: str
    language: str
    code: str
    statuses: tuple[RunStatus, ...]
    markers: tuple[str, ...]  # each must appear in stdout or stderr
    spec: dict[str, Any] = field(default_factory=dict)
    check: Callable[[RunResult, SandboxSpec], None] | None = None
    writes_outside: bool = False  # look for ESCAPE_NAME files on the host afterwards
    crowd: int = 0  # run processes the host must have seen at once (proves a fork bomb went off)


PY_SYSCALL = """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def attempt(label, number, *args):
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    if ret == 0 and os.getpid() != 1:
        os._exit(0)  # a clone that got through: the child leaves, the parent reports
    if ret == -1:
        print(f"BLOCKED {label} errno={ctypes.get_errno()}", flush=True)
    else:
        print(f"LEAKED {label} returned {ret}", flush=True)
"""

# (attack id, program body, the BLOCKED markers it must print), all through ctypes syscall(2).
PY_SYSCALL_ATTACKS: list[tuple[str, str, tuple[str, ...]]] = [
    (
        "ptrace",
        """
        child = os.fork()
        if child == 0:
            time.sleep(5)
            os._exit(0)
        attempt("ptrace_traceme", 101, 0, 0, 0, 0)
        attempt("ptrace_attach", 101, 16, child, 0, 0)
        buffer = ctypes.create_string_buffer(8)
        iov = (ctypes.c_void_p * 2)(ctypes.addressof(buffer), 8)
        attempt("process_vm_readv", 310, child, iov, 1, iov, 1, 0)
        os.kill(child, 9)
        """,
        blocked("ptrace_traceme ptrace_attach process_vm_readv", EPERM),
    ),
    (
        "mount",
        """
        attempt("mount_tmpfs", 165, b"none", b"/tmp", b"tmpfs", 0, None)
        attempt("mount_bind_root", 165, b"/", b"/workspace", None, 0x1000, None)
        attempt("umount_proc", 166, b"/proc", 2)
        attempt("fsopen", 430, b"tmpfs", 0)
        attempt("open_tree", 428, -100, b"/", 1)
        attempt("move_mount", 429, -100, b"/tmp", -100, b"/workspace", 0)
        attempt("chroot", 161, b"/tmp")
        attempt("pivot_root", 155, b"/tmp", b"/tmp")
        """,
        blocked(
            "mount_tmpfs mount_bind_root umount_proc fsopen open_tree move_mount chroot pivot_root", EPERM
        ),
    ),
    (
        "unshare",
        """
        for label, flags in [("user", 0x10000000), ("mnt", 0x20000), ("net", 0x40000000),
                             ("pid", 0x20000000), ("ipc_uts", 0x0C000000), ("cgroup", 0x02000000)]:
            attempt(f"unshare_{label}", 272, flags)
        attempt("clone_newuser", 56, 0x10000000 | 17, 0, 0, 0, 0)
        attempt("clone_newnet", 56, 0x40000000 | 17, 0, 0, 0, 0)
        """,
        blocked(
            "unshare_user unshare_mnt unshare_net unshare_pid unshare_ipc_uts unshare_cgroup"
            " clone_newuser clone_newnet",
            EPERM,
        ),
    ),
    (
        "setns",
        """
        for ns in ("user", "mnt", "net", "pid", "ipc", "uts", "cgroup"):
            attempt(f"setns_{ns}", 308, os.open(f"/proc/self/ns/{ns}", os.O_RDONLY), 0)
        """,
        blocked("setns_user setns_mnt setns_net setns_pid setns_ipc setns_uts setns_cgroup", EPERM),
    ),
    (
        "bpf",
        """
        attr = ctypes.create_string_buffer(128)
        attempt("bpf_map_create", 321, 0, attr, 128)
        attempt("bpf_prog_load", 321, 5, attr, 128)
        """,
        blocked("bpf_map_create bpf_prog_load", EPERM),
    ),
    (
        "perf_event_open",
        """
        import struct
        attr = ctypes.create_string_buffer(struct.pack("=II", 1, 128), 128)  # software clock, size 128
        attempt("perf_event_open_self", 298, attr, 0, -1, -1, 0)
        attempt("perf_event_open_cpu", 298, attr, -1, 0, -1, 0)
        """,
        blocked("perf_event_open_self perf_event_open_cpu", EPERM),
    ),
    (
        "keyctl",
        """
        attempt("keyctl_session", 250, 0, -3, 1)
        attempt("add_key", 248, b"user", b"tether", b"x", 1, -3)
        attempt("request_key", 249, b"user", b"tether", None, -3)
        """,
        blocked("keyctl_session add_key request_key", EPERM),
    ),
    (
        "kexec_and_modules",
        """
        attempt("kexec_load", 246, 0, 0, None, 0)
        attempt("kexec_file_load", 320, -1, -1, 0, b"", 0)
        attempt("init_module", 175, None, 0, b"")
        attempt("finit_module", 313, -1, b"", 0)
        attempt("delete_module", 176, b"ext4", 0)
        attempt("reboot_cad_off", 169, 0xFEE1DEAD, 672274793, 0, None)
        """,
        blocked("kexec_load kexec_file_load init_module finit_module delete_module reboot_cad_off", EPERM),
    ),
    (
        "io_uring",
        """
        params = ctypes.create_string_buffer(120)
        attempt("io_uring_setup", 425, 8, params)
        attempt("io_uring_enter", 426, -1, 0, 0, 0, None, 0)
        attempt("io_uring_register", 427, -1, 0, None, 0)
        """,
        blocked("io_uring_setup io_uring_enter io_uring_register", EPERM),
    ),
    (
        "clone3",
        """
        import struct
        for label, flags in [("clone3_newuser", 0x10000000), ("clone3_newns", 0x20000),
                             ("clone3_newpid", 0x20000000)]:
            args = ctypes.create_string_buffer(struct.pack("=8Q", flags, 0, 0, 0, 17, 0, 0, 0), 64)
            attempt(label, 435, args, 64)
        """,
        blocked("clone3_newuser clone3_newns clone3_newpid", ENOSYS),
    ),
    (
        "cross_process_handles",
        """
        attempt("userfaultfd", 323, 0)
        attempt("kcmp", 312, 1, 1, 0, 0, 0)
        attempt("pidfd_getfd", 438, os.pidfd_open(os.getpid()), 0, 0)
        attempt("open_by_handle_at", 304, -100, ctypes.create_string_buffer(136), 0)
        """,
        blocked("userfaultfd kcmp pidfd_getfd open_by_handle_at", EPERM),
    ),
    (
        "host_knobs",
        """
        import struct
        # Out-of-range values: were the call ever allowed, the kernel would refuse them (EINVAL), not obey.
        invalid_time = ctypes.create_string_buffer(struct.pack("=qq", 0, 2_000_000_000), 16)
        buffer = ctypes.create_string_buffer(256)
        attempt("settimeofday", 164, invalid_time, None)
        attempt("clock_settime", 227, 0, invalid_time)
        attempt("adjtimex", 159, buffer)
        attempt("sethostname", 170, b"pwned", 5)
        attempt("setdomainname", 171, b"pwned", 5)
        attempt("syslog_read_all", 103, 3, buffer, 256)
        attempt("swapon", 167, b"/tmp/swap", 0)
        attempt("acct", 163, b"/nonexistent/acct")
        attempt("iopl_lower", 172, 0)  # lowering needs no capability: only the filter refuses it
        attempt("ioperm_off", 173, 0x80, 1, 0)
        attempt("personality", 135, 0x0040000)
        """,
        blocked(
            "settimeofday clock_settime adjtimex sethostname setdomainname syslog_read_all swapon acct"
            " iopl_lower ioperm_off personality",
            EPERM,
        ),
    ),
]


def _syscall_attack(name: str, body: str, markers: tuple[str, ...]) -> Attack:
    return Attack(
        f"py_syscall_{name}", "python", PY_SYSCALL + textwrap.dedent(body), (RunStatus.OK,), markers
    )


C_PRELUDE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <sys/wait.h>

static void report(const char *label, long ret) {
    if (ret == -1) printf("BLOCKED %s errno=%d\n", label, errno);
    else printf("LEAKED %s returned %ld\n", label, ret);
    fflush(stdout);
}
"""


def _c(body: str) -> str:
    return C_PRELUDE + textwrap.dedent(body)


def _check_memory(result: RunResult, spec: SandboxSpec) -> None:
    assert 0 < result.peak_memory_kib <= spec.memory_mib * 1024, result.peak_memory_kib
    reached = [int(n) for n in re.findall(r"^MiB (\d+)$", result.stdout, re.M)]
    assert reached and max(reached) <= spec.memory_mib, reached


def _check_fork_limit(result: RunResult, spec: SandboxSpec) -> None:
    counts = [int(n) for n in re.findall(r"FORK_LIMITED after (\d+)", result.stdout)]
    assert counts and all(count < spec.pids_max for count in counts), counts


def _check_disk(result: RunResult, spec: SandboxSpec) -> None:
    (total,) = (int(n) for n in re.findall(r"DISK_FULL total=(\d+)", result.stdout))
    assert (spec.disk_mib - 1) * 2**20 <= total <= spec.disk_mib * 2**20, total


def _check_wall_timeout(result: RunResult, spec: SandboxSpec) -> None:
    assert spec.timeout_s * 1000 <= result.wall_ms <= spec.timeout_s * 1000 + 1000, result.wall_ms


def _check_cpu_share(result: RunResult, spec: SandboxSpec) -> None:
    _check_wall_timeout(result, spec)
    share = result.cpu_ms / result.wall_ms
    assert result.cpu_ms > 50, "the spinners never ran"
    assert share <= spec.cpu_limit * 1.2 + 0.05, f"{share:.2f} cores used, limit {spec.cpu_limit}"


def _check_output_cap(result: RunResult, spec: SandboxSpec) -> None:
    capped = result.stdout if result.stdout_truncated else result.stderr
    assert result.stdout_truncated or result.stderr_truncated
    assert len(capped.encode()) == spec.output_limit_bytes, len(capped)
    assert len(result.stdout.encode()) <= spec.output_limit_bytes
    assert len(result.stderr.encode()) <= spec.output_limit_bytes


def _check_setuid_count(result: RunResult, spec: SandboxSpec) -> None:
    on_host = sum(
        1
        for directory in ("/usr/bin", "/usr/sbin")
        for entry in os.scandir(directory)
        if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mode & stat.S_ISUID
    )
    assert f"SETUID_FOUND {on_host}\n" in result.stdout, f"host has {on_host} setuid binaries"


def _check_rlimit_nofile(result: RunResult, spec: SandboxSpec) -> None:
    (opened,) = (int(n) for n in re.findall(r"NOFILE_LIMITED after (\d+)", result.stdout))
    assert opened <= spec.open_files_max, opened


ATTACKS: list[Attack] = [
    *(_syscall_attack(*entry) for entry in PY_SYSCALL_ATTACKS),
    Attack(
        "py_memory_bomb",
        "python",
        """
        chunks = []
        print("ALLOCATING", flush=True)
        while True:
            chunks.append(b"\\x01" * (4 << 20))
            print("MiB", len(chunks) * 4, flush=True)
        """,
        (RunStatus.MEMORY_LIMIT,),
        ("ALLOCATING", "MiB 4"),
        {"memory_mib": 64},
        _check_memory,
    ),
    Attack(
        "c_memory_bomb",
        "c",
        _c("""
        int main(void) {
            size_t total = 0;
            for (;;) {
                char *block = malloc(4 << 20);
                if (!block) { printf("LEAKED malloc failed before the limit\\n"); return 3; }
                memset(block, 1, 4 << 20);
                total += 4 << 20;
                printf("MiB %zu\\n", total >> 20);
                fflush(stdout);
            }
        }
        """),
        (RunStatus.MEMORY_LIMIT,),
        ("MiB 4",),
        C_SPEC,
        _check_memory,
    ),
    Attack(
        "py_fork_bomb",
        "python",
        """
        import os, time
        print("BOMB_START", flush=True)
        forks, reported = 0, False
        while True:
            try:
                if os.fork() == 0:
                    forks = 0
                    continue
                forks += 1
            except OSError as error:
                if os.getpid() == 1 and not reported:
                    print(f"FORK_LIMITED after {forks} errno={error.errno}", flush=True)
                    reported = True
                time.sleep(0.005)
        """,
        FAILED,
        ("BOMB_START", "FORK_LIMITED"),
        {"timeout_s": 1.0},
        _check_fork_limit,
        crowd=16,
    ),
    Attack(
        "bash_fork_bomb",
        "bash",
        """
        echo BOMB_START
        bomb() { bomb | bomb & }
        bomb
        sleep 30
        """,
        FAILED,
        ("BOMB_START", "Resource temporarily unavailable"),
        {"timeout_s": 1.0},
        crowd=16,
    ),
    Attack(
        "c_fork_bomb",
        "c",
        _c("""
        int main(void) {
            int forks = 0, reported = 0;
            printf("BOMB_START\\n");
            fflush(stdout);
            for (;;) {
                pid_t child = fork();
                if (child == 0) { forks = 0; continue; }
                if (child > 0) { forks++; continue; }
                if (getpid() == 1 && !reported) {
                    printf("FORK_LIMITED after %d errno=%d\\n", forks, errno);
                    fflush(stdout);
                    reported = 1;
                }
                usleep(5000);
            }
        }
        """),
        FAILED,
        ("BOMB_START", "FORK_LIMITED"),
        {**C_SPEC, "timeout_s": 1.0},
        _check_fork_limit,
        crowd=16,
    ),
    Attack(
        "py_disk_fill",
        "python",
        """
        import os
        total, block = 0, b"\\0" * (1 << 20)
        for path in ("/workspace/fill", "/tmp/fill", "/dev/shm/fill", "/workspace/more"):
            try:
                with open(path, "wb", buffering=0) as handle:
                    while total < 256 << 20:
                        total += handle.write(block)
                print("LEAKED wrote 256 MiB", flush=True)
            except OSError as error:
                print(f"FULL {path} errno={error.errno}", flush=True)
        print(f"DISK_FULL total={total}")
        """,
        (RunStatus.OK,),
        ("FULL /workspace/fill", "FULL /tmp/fill", "FULL /dev/shm/fill", "DISK_FULL"),
        {"memory_mib": 64},
        _check_disk,
    ),
    Attack(
        "py_cpu_spin",
        "python",
        """
        print("SPINNING", flush=True)
        while True:
            pass
        """,
        (RunStatus.TIMEOUT,),
        ("SPINNING",),
        {"timeout_s": 1.0, "cpu_limit": 0.5},
        _check_cpu_share,
    ),
    Attack(
        "py_fork_spin_over_cpu_limit",
        "python",
        """
        import os
        for _ in range(3):
            if os.fork() == 0:
                while True:
                    pass
        print("SPINNERS 4", flush=True)
        while True:
            pass
        """,
        (RunStatus.TIMEOUT,),
        ("SPINNERS 4",),
        {"timeout_s": 1.0, "cpu_limit": 0.5},
        _check_cpu_share,
    ),
    Attack(
        "c_threads_spin_over_cpu_limit",
        "c",
        _c("""
        static void *spin(void *unused) { for (volatile unsigned long n = 0;; n++) {} return unused; }
        int main(void) {
            pthread_t threads[4];
            for (int i = 0; i < 4; i++)
                if (pthread_create(&threads[i], NULL, spin, NULL) == 0) printf("THREAD %d\\n", i);
            fflush(stdout);
            spin(NULL);
        }
        """),
        (RunStatus.TIMEOUT,),
        ("THREAD 3",),
        {**C_SPEC, "timeout_s": 1.0, "cpu_limit": 1.0},
        _check_cpu_share,
    ),
    Attack(
        "py_sleep_past_timeout",
        "python",
        """
        import time
        print("SLEEPING", flush=True)
        time.sleep(60)
        print("LEAKED woke up")
        """,
        (RunStatus.TIMEOUT,),
        ("SLEEPING",),
        {"timeout_s": 1.0},
        _check_wall_timeout,
    ),
    Attack(
        "bash_sleep_past_timeout",
        "bash",
        "echo SLEEPING; sleep 60; echo LEAKED woke up\n",
        (RunStatus.TIMEOUT,),
        ("SLEEPING",),
        {"timeout_s": 1.0},
        _check_wall_timeout,
    ),
    Attack(
        "py_stdout_flood",
        "python",
        """
        import sys
        sys.stdout.write("FLOOD_START\\n")
        while True:
            sys.stdout.write("F" * 65536)
        """,
        (RunStatus.OUTPUT_LIMIT,),
        ("FLOOD_START",),
        {"output_limit_kib": 16},
        _check_output_cap,
    ),
    Attack(
        "py_stderr_flood",
        "python",
        """
        import sys
        print("FLOOD_START", flush=True)
        while True:
            sys.stderr.write("E" * 65536)
        """,
        (RunStatus.OUTPUT_LIMIT,),
        ("FLOOD_START",),
        {"output_limit_kib": 16},
        _check_output_cap,
    ),
    Attack(
        "bash_yes_flood",
        "bash",
        "echo FLOOD_START; yes flood\n",
        (RunStatus.OUTPUT_LIMIT,),
        ("FLOOD_START",),
        {"output_limit_kib": 16},
        _check_output_cap,
    ),
    Attack(
        "py_write_everywhere_outside",
        "python",
        """
        import os, sys, sysconfig
        name, writable = "@NAME@", ("/workspace", "/tmp", "/dev/shm", "/mnt")
        tried = 0
        def try_create(directory):
            global tried
            path = os.path.join(directory, name)
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            except OSError:
                tried += 1
                return
            print("LEAKED created", path, flush=True)
        paths = sysconfig.get_paths()
        deep = [sys.prefix, sys.base_prefix, paths["purelib"], paths["stdlib"]]
        for top in ["/", *deep]:
            for directory, subdirectories, _ in os.walk(top):
                if directory.startswith(("/proc",) + writable) or directory.count("/") - top.count("/") >= 2:
                    subdirectories.clear()
                if not directory.startswith(writable):
                    try_create(directory)
        for directory in ("/.staging", "/proc", "/proc/self", "/proc/sys", "/sys", "/dev", "/dev/shm/.."):
            try_create(directory)
        for path in ("/proc/sys/kernel/hostname", "/proc/sys/kernel/core_pattern", "/proc/sys/vm/drop_caches",
                     "/proc/sysrq-trigger", "/proc/self/uid_map", "/proc/self/oom_score_adj", "/etc/passwd",
                     "/usr/bin/env", sys.executable):
            try:
                os.close(os.open(path, os.O_WRONLY))  # opened only: nothing is ever written
                print("LEAKED writable", path, flush=True)
            except OSError as error:
                print("BLOCKED open_for_write", path, error.errno)
        for label, action in [("mkdir", lambda: os.mkdir(f"/etc/{name}")),
                              ("symlink", lambda: os.symlink("/etc/passwd", f"/usr/{name}")),
                              ("chmod", lambda: os.chmod("/usr/bin", 0o777)),
                              ("utime", lambda: os.utime("/etc/passwd")),
                              ("chown", lambda: os.chown("/usr/bin/env", 1000, 1000))]:
            try:
                action()
                print("LEAKED", label, flush=True)
            except OSError as error:
                print("BLOCKED", label, error.errno)
        for line in open("/proc/self/mountinfo"):
            fields = line.split()
            point, options = fields[4], fields[5].split(",")
            allowed = writable + ("/proc", "/.staging", "/dev/null", "/dev/zero", "/dev/full",
                                  "/dev/random", "/dev/urandom")
            if "rw" in options and not point.startswith(allowed):
                print("LEAKED read-write mount", point, flush=True)
        print(f"BLOCKED_DIRECTORIES {tried}")
        """.replace("@NAME@", ESCAPE_NAME),
        (RunStatus.OK,),
        (
            "BLOCKED_DIRECTORIES ",
            "BLOCKED open_for_write /proc/sysrq-trigger",
            "BLOCKED open_for_write /proc/sys/kernel/core_pattern",
            "BLOCKED mkdir",
            "BLOCKED symlink",
            "BLOCKED chmod",
            "BLOCKED utime",
            "BLOCKED chown",
        ),
        {"timeout_s": 5.0},
        writes_outside=True,
    ),
    Attack(
        "c_write_outside",
        "c",
        _c("""
        int main(void) {
            const char *dirs[] = {"/", "/usr", "/usr/bin", "/usr/lib", "/etc", "/root", "/dev", "/proc",
                                  "/.staging", "/bin", "/lib", NULL};
            char path[256];
            for (int i = 0; dirs[i]; i++) {
                snprintf(path, sizeof path, "%s/@NAME@", dirs[i]);
                report(path, open(path, O_WRONLY | O_CREAT | O_EXCL, 0644));
            }
            report("proc_sys_hostname", open("/proc/sys/kernel/hostname", O_WRONLY));
            report("sysrq_trigger", open("/proc/sysrq-trigger", O_WRONLY));
            report("mkdir_etc", mkdir("/etc/@NAME@", 0755));
            report("symlink_usr", symlink("/etc/passwd", "/usr/@NAME@"));
            report("mknod_dev", mknod("/dev/@NAME@", S_IFCHR | 0666, makedev(1, 3)));
            return 0;
        }
        """).replace("@NAME@", ESCAPE_NAME),
        (RunStatus.OK,),
        (
            f"BLOCKED /etc/{ESCAPE_NAME}",
            f"BLOCKED /usr/bin/{ESCAPE_NAME}",
            f"BLOCKED /.staging/{ESCAPE_NAME}",
            "BLOCKED proc_sys_hostname",
            "BLOCKED sysrq_trigger",
            "BLOCKED mkdir_etc",
            "BLOCKED symlink_usr",
            "BLOCKED mknod_dev",
        ),
        C_SPEC,
        writes_outside=True,
    ),
    Attack(
        "py_raise_rlimits",
        "python",
        """
        import os, resource
        for name in ("RLIMIT_NOFILE", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_CORE"):
            limit = getattr(resource, name)
            _, hard = resource.getrlimit(limit)
            try:
                resource.setrlimit(limit, (hard + 1, hard + 1))
                print("LEAKED", name, resource.getrlimit(limit), flush=True)
            except (ValueError, OSError) as error:
                print("BLOCKED", name, error)
            try:
                resource.prlimit(1, limit, (hard + 1, hard + 1))
                print("LEAKED prlimit", name, flush=True)
            except (ValueError, OSError):
                print("BLOCKED prlimit", name)
        opened = []
        try:
            while len(opened) < 100000:
                opened.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            print(f"NOFILE_LIMITED after {len(opened)}")
        """,
        (RunStatus.OK,),
        (
            "BLOCKED RLIMIT_NOFILE",
            "BLOCKED RLIMIT_CPU",
            "BLOCKED RLIMIT_FSIZE",
            "BLOCKED RLIMIT_CORE",
            "BLOCKED prlimit RLIMIT_CPU",
            "NOFILE_LIMITED",
        ),
        {},
        _check_rlimit_nofile,
    ),
    Attack(
        "c_raise_rlimits",
        "c",
        _c("""
        int main(void) {
            int limits[] = {RLIMIT_NOFILE, RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_CORE};
            const char *names[] = {"RLIMIT_NOFILE", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_CORE"};
            for (int i = 0; i < 4; i++) {
                struct rlimit limit;
                getrlimit(limits[i], &limit);
                limit.rlim_max += 1;
                limit.rlim_cur = limit.rlim_max;
                report(names[i], setrlimit(limits[i], &limit));
            }
            return 0;
        }
        """),
        (RunStatus.OK,),
        blocked("RLIMIT_NOFILE RLIMIT_CPU RLIMIT_FSIZE", EPERM),
        C_SPEC,
    ),
    Attack(
        "c_ptrace",
        "c",
        _c("""
        int main(void) {
            report("ptrace_traceme", ptrace(PTRACE_TRACEME, 0, 0, 0));
            pid_t child = fork();
            if (child == 0) { pause(); _exit(0); }
            report("ptrace_attach", ptrace(PTRACE_ATTACH, child, 0, 0));
            report("ptrace_seize", ptrace(PTRACE_SEIZE, child, 0, 0));
            char buffer[8];
            struct iovec local = {buffer, 8}, remote = {buffer, 8};
            report("process_vm_readv", process_vm_readv(child, &local, 1, &remote, 1, 0));
            kill(child, SIGKILL);
            waitpid(child, NULL, 0);
            return 0;
        }
        """),
        (RunStatus.OK,),
        blocked("ptrace_traceme ptrace_attach ptrace_seize process_vm_readv", EPERM),
        C_SPEC,
    ),
    Attack(
        "c_mount",
        "c",
        _c("""
        int main(void) {
            report("mount_tmpfs", mount("none", "/tmp", "tmpfs", 0, NULL));
            report("mount_bind", mount("/", "/workspace", NULL, MS_BIND | MS_REC, NULL));
            report("remount_root_rw", mount("none", "/", NULL, MS_REMOUNT | MS_BIND, NULL));
            report("umount_proc", umount2("/proc", MNT_DETACH));
            report("fsopen", syscall(430, "tmpfs", 0));
            report("chroot", chroot("/tmp"));
            return 0;
        }
        """),
        (RunStatus.OK,),
        blocked("mount_tmpfs mount_bind remount_root_rw umount_proc fsopen chroot", EPERM),
        C_SPEC,
    ),
    Attack(
        "c_unshare_raw_syscall",
        "c",
        _c("""
        int main(void) {
            report("unshare_user", syscall(SYS_unshare, CLONE_NEWUSER));
            report("unshare_user_mnt", syscall(SYS_unshare, CLONE_NEWUSER | CLONE_NEWNS));
            report("unshare_net", syscall(SYS_unshare, CLONE_NEWNET));
            long child = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
            if (child == 0) _exit(0);
            report("clone_newuser", child);
            report("setns_user", syscall(SYS_setns, open("/proc/self/ns/user", O_RDONLY), 0));
            report("setns_mnt", syscall(SYS_setns, open("/proc/self/ns/mnt", O_RDONLY), 0));
            return 0;
        }
        """),
        (RunStatus.OK,),
        blocked("unshare_user unshare_user_mnt unshare_net clone_newuser setns_user setns_mnt", EPERM),
        C_SPEC,
    ),
    Attack(
        "c_clone3_namespaces",
        "c",
        _c("""
        struct clone_args_v0 { uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, size, tls; };
        int main(void) {
            uint64_t flags[] = {CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET | CLONE_NEWUSER};
            const char *labels[] = {"clone3_newuser", "clone3_newns", "clone3_newpid", "clone3_newnet"};
            for (int i = 0; i < 4; i++) {
                struct clone_args_v0 args = {.flags = flags[i], .exit_signal = SIGCHLD};
                long child = syscall(435, &args, sizeof args);
                if (child == 0) _exit(0);
                report(labels[i], child);
            }
            return 0;
        }
        """),
        (RunStatus.OK,),
        blocked("clone3_newuser clone3_newns clone3_newpid clone3_newnet", ENOSYS),
        C_SPEC,
    ),
    Attack(
        "c_io_uring",
        "c",
        _c("""
        int main(void) {
            unsigned char params[120] = {0};
            report("io_uring_setup", syscall(425, 8, params));
            report("io_uring_enter", syscall(426, -1, 0, 0, 0, NULL, 0));
            report("io_uring_register", syscall(427, -1, 0, NULL, 0));
            return 0;
        }
        """),
        (RunStatus.OK,),
        blocked("io_uring_setup io_uring_enter io_uring_register", EPERM),
        C_SPEC,
    ),
    Attack(
        "c_int80_32bit_abi",
        "c",
        _c("""
        int main(void) {
            long ret;
            printf("BEFORE_INT80\\n");
            fflush(stdout);
            /* i386 unshare(CLONE_NEWUSER): the 32-bit table is not the one the filter checks */
            __asm__ volatile ("int $0x80" : "=a"(ret) : "a"(310L), "b"(0x10000000L) : "memory");
            printf("LEAKED int80 unshare returned %ld\\n", ret);
            __asm__ volatile ("int $0x80" : "=a"(ret) : "a"(24L) : "memory");
            printf("LEAKED int80 getuid returned %ld\\n", ret);
            return 0;
        }
        """),
        (RunStatus.RUNTIME_ERROR,),
        ("BEFORE_INT80",),
        C_SPEC,
        lambda result, _: _assert_signal(result, signal.SIGSYS),
    ),
    Attack(
        "c_x32_abi",
        "c",
        _c("""
        int main(void) {
            printf("BEFORE_X32\\n");
            fflush(stdout);
            report("x32_unshare", syscall(0x40000000L | SYS_unshare, CLONE_NEWUSER));
            report("x32_getuid", syscall(0x40000000L | SYS_getuid));
            return 0;
        }
        """),
        (RunStatus.OK, RunStatus.RUNTIME_ERROR),  # refused (no x32 in the kernel) or killed by the filter
        ("BEFORE_X32",),
        C_SPEC,
    ),
    Attack(
        "bash_setuid_binaries",
        "bash",
        r"""
        n=0
        for f in /usr/bin/* /usr/sbin/*; do [ -u "$f" ] && [ ! -L "$f" ] && n=$((n+1)); done
        echo "SETUID_FOUND $n"
        grep -q '^NoNewPrivs:[[:space:]]*1' /proc/self/status && echo "NNP 1"
        grep -q '^CapEff:[[:space:]]*0000000000000000' /proc/self/status && echo "CAPEFF 0"
        try() {
            label=$1; shift
            out=$("$@" 2>&1 </dev/null)
            if [ "$out" = "0" ]; then echo "LEAKED $label"; else echo "BLOCKED $label"; fi
        }
        try su su root -c 'id -u'
        try mount sh -c 'mount -t tmpfs none /tmp && id -u'
        try newgrp sh -c 'echo "id -u" | newgrp root'
        try unshare_r unshare -r id -u
        try suid_copy sh -c 'cp /usr/bin/su su && chmod 4755 su && ./su -c "id -u"'
        echo "END euid=$(id -u)"
        """,
        (RunStatus.OK,),
        (
            "SETUID_FOUND",
            "NNP 1",
            "CAPEFF 0",
            "BLOCKED su",
            "BLOCKED mount",
            "BLOCKED newgrp",
            "BLOCKED unshare_r",
            "BLOCKED suid_copy",
            f"END euid={RUN_UID}",
        ),
        {"timeout_s": 5.0},
        _check_setuid_count,
    ),
    Attack(
        "py_dev_access",
        "python",
        """
        import os, stat
        allowed = {"null", "zero", "full", "random", "urandom", "fd", "stdin", "stdout", "stderr", "shm"}
        extra = sorted(set(os.listdir("/dev")) - allowed)
        print("LEAKED device entries", extra) if extra else print("DEV_MINIMAL")
        for name in ["vda", "sda", "nvme0n1", "mem", "kmem", "port", "kmsg", "tty", "console", "kvm", "fuse",
                     "net/tun", "loop-control", "mapper/control", "cpu/0/msr", "hpet", "uinput", "watchdog",
                     "nvidia0", "dri/card0", "autofs", "btrfs-control", "vhost-net"]:
            try:
                os.close(os.open("/dev/" + name, os.O_RDONLY | os.O_NONBLOCK))
                print("LEAKED opened /dev/" + name)
            except OSError as error:
                print("BLOCKED", name, error.errno)
        for label, path, kind, device in [("mknod_disk", "/workspace/vda", stat.S_IFBLK, (254, 0)),
                                          ("mknod_mem", "/tmp/mem", stat.S_IFCHR, (1, 1)),
                                          ("mknod_kmsg", "/dev/shm/kmsg", stat.S_IFCHR, (1, 11))]:
            try:
                os.mknod(path, kind | 0o666, os.makedev(*device))
                print("LEAKED", label)
            except OSError as error:
                print("BLOCKED", label, error.errno)
        """,
        (RunStatus.OK,),
        (
            "DEV_MINIMAL",
            "BLOCKED vda",
            "BLOCKED mem",
            "BLOCKED kmsg",
            "BLOCKED mknod_disk",
            "BLOCKED mknod_mem",
        ),
    ),
]


def _assert_signal(result: RunResult, expected: signal.Signals) -> None:
    assert result.signal == expected, describe(result)


@pytest.mark.parametrize("attack", [pytest.param(a, id=a.id) for a in ATTACKS])
async def test_attack_is_contained(attack: Attack) -> None:
    spec = sandbox_spec(**attack.spec)
    disk_before = {path: shutil.disk_usage(path).free for path in ("/", "/tmp")}
    state_before = host_state()
    async with open_sandbox(**attack.spec) as sandbox, asyncio.timeout(60):
        with process_sampler() as samples:
            result = await sandbox.run(program(attack.code), attack.language)
    output = result.stdout + result.stderr
    assert result.status in attack.statuses, describe(result)
    assert "LEAKED" not in output, describe(result)
    for marker in attack.markers:
        assert marker in output, f"missing {marker!r}: the attack did not run as designed\n{describe(result)}"
    if attack.check is not None:
        attack.check(result, spec)
    seen = max(samples, default=0)
    assert attack.crowd <= seen <= spec.pids_max, f"the host saw {seen} run processes at once"
    assert host_state() == state_before
    for path, free in disk_before.items():
        assert shutil.disk_usage(path).free > free - 64 * 2**20, f"host disk at {path} filled up"
    if attack.writes_outside:
        assert host_escape_files() == []


# ---------------------------------------------------------------- network


@dataclass
class HostListeners:
    """Servers on the host that an escaped run would reach; each must end the test untouched."""

    tcp: socket.socket
    udp: socket.socket
    unix: socket.socket
    abstract: socket.socket
    unix_path: str
    abstract_name: str

    @property
    def tcp_port(self) -> int:
        return int(self.tcp.getsockname()[1])

    @property
    def udp_port(self) -> int:
        return int(self.udp.getsockname()[1])

    def assert_untouched(self) -> None:
        for name in ("tcp", "unix", "abstract"):
            with pytest.raises(BlockingIOError):
                getattr(self, name).accept()
                pytest.fail(f"the host {name} server received a connection from the sandbox")
        with pytest.raises(BlockingIOError):
            data = self.udp.recvfrom(4096)
            pytest.fail(f"the host UDP server received {data!r} from the sandbox")


@pytest.fixture
def host_listeners(tmp_path: Path) -> Iterator[HostListeners]:
    tcp = socket.create_server(("0.0.0.0", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", 0))
    unix_path = str(tmp_path / "host.sock")
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(unix_path)
    unix.listen()
    abstract_name = f"tether-escape-{TOKEN}"
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind("\0" + abstract_name)
    abstract.listen()
    sockets = (tcp, udp, unix, abstract)
    for sock in sockets:
        sock.setblocking(False)
    try:
        yield HostListeners(tcp, udp, unix, abstract, unix_path, abstract_name)
    finally:
        for sock in sockets:
            sock.close()


HOST_SERVICE_SOCKETS = (
    "/var/run/postgresql/.s.PGSQL.5432",
    "/run/postgresql/.s.PGSQL.5432",
    "/run/mysqld/mysqld.sock",
    "/run/dbus/system_bus_socket",
    "/var/run/docker.sock",
    "/run/systemd/private",
    "/dev/log",
)

NETWORK_PROGRAMS = {
    "python": """
        import json, socket
        targets = json.loads('@TARGETS@')
        def outcome(label, error):
            print(f"BLOCKED {label} errno={error}" if error else f"LEAKED {label}", flush=True)
        for host, port in targets["tcp"]:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(1)
                outcome(f"tcp {host}:{port}", sock.connect_ex((host, port)))
        for host, port in targets["udp"]:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                try:
                    sock.sendto(b"TETHER-PROBE", (host, port))
                    print(f"SENT udp {host}:{port}")  # the host's server decides whether it arrived
                except OSError as error:
                    outcome(f"udp {host}:{port}", error.errno)
        for path in targets["unix"]:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                outcome(f"unix {path}", sock.connect_ex(path.replace("@", "\\0", 1)))
        for name in targets["dns"]:
            try:
                print(socket.getaddrinfo(name, 80))
                outcome(f"dns {name}", 0)
            except socket.gaierror as error:
                outcome(f"dns {name}", error.errno)
        print("INTERFACES", sorted(name for _, name in socket.if_nameindex()))
        for label, args in [("raw_icmp", (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)),
                            ("packet", (socket.AF_PACKET, socket.SOCK_RAW, 0))]:
            try:
                socket.socket(*args).close()
                outcome(label, 0)
            except OSError as error:
                outcome(label, error.errno)
        """,
    "c": r"""
        #include <arpa/inet.h>
        #include <errno.h>
        #include <stddef.h>
        #include <stdio.h>
        #include <string.h>
        #include <sys/socket.h>
        #include <sys/un.h>
        #include <unistd.h>
        static void tcp(const char *host, int port) {
            struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons(port)};
            inet_pton(AF_INET, host, &address.sin_addr);
            int fd = socket(AF_INET, SOCK_STREAM, 0);
            if (connect(fd, (struct sockaddr *)&address, sizeof address) == 0)
                printf("LEAKED tcp %s:%d\n", host, port);
            else printf("BLOCKED tcp %s:%d errno=%d\n", host, port, errno);
            close(fd);
        }
        static void unix_stream(const char *path, int abstract) {
            struct sockaddr_un address = {.sun_family = AF_UNIX};
            strncpy(address.sun_path + abstract, path, sizeof address.sun_path - 2);
            socklen_t length = offsetof(struct sockaddr_un, sun_path) + abstract + strlen(path);
            int fd = socket(AF_UNIX, SOCK_STREAM, 0);
            if (connect(fd, (struct sockaddr *)&address, length) == 0) printf("LEAKED unix %s\n", path);
            else printf("BLOCKED unix %s errno=%d\n", path, errno);
            close(fd);
        }
        int main(void) {
            tcp("127.0.0.1", @TCP_PORT@);
            tcp("1.1.1.1", 443);
            @HOST_TCP@
            struct sockaddr_in udp = {.sin_family = AF_INET, .sin_port = htons(@UDP_PORT@)};
            inet_pton(AF_INET, "127.0.0.1", &udp.sin_addr);
            int fd = socket(AF_INET, SOCK_DGRAM, 0);
            sendto(fd, "TETHER-PROBE", 12, 0, (struct sockaddr *)&udp, sizeof udp);
            unix_stream("@UNIX_PATH@", 0);
            unix_stream("/var/run/postgresql/.s.PGSQL.5432", 0);
            unix_stream("@ABSTRACT@", 1);
            return 0;
        }
        """,
    "bash": """
        probe() {
            if (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
            then echo "LEAKED tcp $1:$2"
            else echo "BLOCKED tcp $1:$2"
            fi
        }
        probe 127.0.0.1 @TCP_PORT@
        probe 127.0.0.1 5432
        probe 1.1.1.1 443
        @HOST_TCP@
        echo TETHER-PROBE 2>/dev/null > /dev/udp/127.0.0.1/@UDP_PORT@
        getent hosts example.com && echo "LEAKED dns" || echo "BLOCKED dns example.com"
        """,
    "javascript": """
        const net = require("net");
        const targets = [["127.0.0.1", @TCP_PORT@], ["1.1.1.1", 443], @HOST_TCP@ {path: "@UNIX_PATH@"}];
        for (const target of targets) {
            const options = Array.isArray(target) ? {host: target[0], port: target[1]} : target;
            const label = Array.isArray(target) ? `tcp ${target[0]}:${target[1]}` : `unix ${target.path}`;
            const socket = net.connect(options);
            socket.setTimeout(1000);
            socket.on("connect", () => { console.log(`LEAKED ${label}`); socket.destroy(); });
            socket.on("error", (error) => console.log(`BLOCKED ${label} ${error.code}`));
            socket.on("timeout", () => { console.log(`BLOCKED ${label} timeout`); socket.destroy(); });
        }
        """,
}


def _network_program(language: str, listeners: HostListeners, host_ips: list[str]) -> tuple[str, list[str]]:
    """The attack for `language` and the BLOCKED markers it must print."""
    tcp_targets = [("127.0.0.1", listeners.tcp_port), ("1.1.1.1", 443)]
    tcp_targets += [(ip, listeners.tcp_port) for ip in host_ips if ip != "127.0.0.1"]
    if language == "python":
        tcp_targets += [
            ("::1", listeners.tcp_port),
            ("169.254.169.254", 80),
            ("8.8.8.8", 53),
            ("127.0.0.1", 5432),
            ("127.0.0.1", 6379),
        ]
        targets = {
            "tcp": tcp_targets,
            "udp": [("127.0.0.1", listeners.udp_port), *((ip, listeners.udp_port) for ip in host_ips)],
            "unix": [listeners.unix_path, "@" + listeners.abstract_name, *HOST_SERVICE_SOCKETS],
            "dns": ["example.com", "pypi.org", "metadata.google.internal"],
        }
        markers = [f"BLOCKED tcp {host}:{port}" for host, port in tcp_targets]
        markers += [f"BLOCKED unix {path}" for path in targets["unix"]]
        markers += [f"BLOCKED dns {name}" for name in targets["dns"]]
        markers += ["INTERFACES ['lo']", "BLOCKED raw_icmp", "BLOCKED packet"]
        return program(NETWORK_PROGRAMS["python"], TARGETS=json.dumps(targets)), markers
    host_tcp = {
        "c": "".join(f'tcp("{ip}", {listeners.tcp_port});' for ip in host_ips),
        "bash": "\n".join(f"probe {ip} {listeners.tcp_port}" for ip in host_ips),
        "javascript": "".join(f'["{ip}", {listeners.tcp_port}], ' for ip in host_ips),
    }[language]
    code = program(
        NETWORK_PROGRAMS[language],
        TCP_PORT=listeners.tcp_port,
        UDP_PORT=listeners.udp_port,
        UNIX_PATH=listeners.unix_path,
        ABSTRACT=listeners.abstract_name,
        HOST_TCP=host_tcp,
    )
    markers = [f"BLOCKED tcp {host}:{port}" for host, port in tcp_targets]
    markers += {
        "c": [f"BLOCKED unix {listeners.unix_path}", f"BLOCKED unix {listeners.abstract_name}"],
        "bash": ["BLOCKED dns example.com"],
        "javascript": [f"BLOCKED unix {listeners.unix_path}"],
    }[language]
    return code, markers


@pytest.mark.parametrize("language", ["python", "c", "bash", "javascript"])
async def test_network_egress_never_reaches_the_host(language: str, host_listeners: HostListeners) -> None:
    if language == "javascript" and shutil.which("node") is None:
        pytest.skip("node is not installed")
    host_ips = host_ipv4_addresses()
    code, markers = _network_program(language, host_listeners, host_ips)
    async with open_sandbox(memory_mib=192, timeout_s=8) as sandbox:
        result = await sandbox.run(code, language)
    assert result.status is RunStatus.OK, describe(result)
    assert "LEAKED" not in result.stdout, describe(result)
    for marker in markers:
        assert marker in result.stdout, f"missing {marker!r}\n{describe(result)}"
    host_listeners.assert_untouched()


# ---------------------------------------------------------------- host secrets


@dataclass
class PlantedSecrets:
    """Files on the host that no run may read (or, for `public`, change)."""

    paths: dict[str, Path]  # label -> path; every label but "public" holds a secret
    contents: dict[str, str]

    def snapshot(self) -> dict[str, tuple[bytes, int, int, float]]:
        result = {}
        for label, path in self.paths.items():
            info = path.stat()
            result[label] = (path.read_bytes(), info.st_mode, info.st_uid, info.st_mtime)
        return result


@pytest.fixture
def planted_secrets(tmp_path: Path) -> Iterator[PlantedSecrets]:
    paths = {
        "tmp": tmp_path / "host-secret.txt",
        "root": Path(f"/root/{ESCAPE_NAME}.secret"),
        "etc": Path(f"/etc/{ESCAPE_NAME}.secret"),
        "public": Path(f"/etc/{ESCAPE_NAME}.public"),
    }
    contents = {label: f"TETHER-SECRET-{secrets.token_hex(8)}" for label in paths}
    contents["public"] = "not a secret, but never to be changed by a run\n"
    try:
        for label, path in paths.items():
            path.write_text(contents[label])
            os.chown(path, 0, 0)
            path.chmod(0o644 if label == "public" else 0o600)
        yield PlantedSecrets(paths, contents)
    finally:
        for path in paths.values():
            path.unlink(missing_ok=True)


SECRET_PROGRAMS = {
    "python": """
        import json, os
        paths = json.loads('@PATHS@')
        needle = "TETHER-" + "SECRET"  # split, or this very file would match
        for label, path in paths.items():
            try:
                with open(path) as handle:
                    text = handle.read()
            except OSError as error:
                print(f"BLOCKED read {label} errno={error.errno}")
                continue
            print(("LEAKED " if needle in text else "READABLE ") + label, text)
        print("ROOT_LISTING", sorted(os.listdir("/root")) if os.path.isdir("/root") else "absent")
        public = paths["public"]
        for label, action in [("append", lambda: open(public, "a").write("pwned")),
                              ("truncate", lambda: os.truncate(public, 0)),
                              ("chmod", lambda: os.chmod(public, 0o666)),
                              ("chown", lambda: os.chown(public, 1000, 1000)),
                              ("utime", lambda: os.utime(public, (0, 0))),
                              ("rename", lambda: os.rename(public, public + ".moved")),
                              ("unlink", lambda: os.unlink(public)),
                              ("replace", lambda: os.replace("/workspace/main.py", public))]:
            try:
                action()
                print("LEAKED", label)
            except OSError as error:
                print(f"BLOCKED {label} public errno={error.errno}")
        found = 0
        for top in ("/etc", "/workspace", "/tmp"):
            for directory, subdirectories, files in os.walk(top):
                # A checkout under /tmp is re-bound read-only into a run's /tmp: no run wrote there.
                if top != "/etc" and os.statvfs(directory).f_flag & os.ST_RDONLY:
                    subdirectories.clear()
                    continue
                for name in files:
                    try:
                        with open(os.path.join(directory, name), "rb") as handle:
                            found += needle.encode() in handle.read(1 << 20)
                    except OSError:
                        pass
        print(f"SEARCHED secrets_found={found}")
        """,
    "c": r"""
        #include <errno.h>
        #include <fcntl.h>
        #include <stdio.h>
        #include <string.h>
        #include <sys/stat.h>
        #include <unistd.h>
        static void steal(const char *label, const char *path) {
            char text[256] = {0};
            int fd = open(path, O_RDONLY);
            if (fd < 0) { printf("BLOCKED read %s errno=%d\n", label, errno); return; }
            read(fd, text, sizeof text - 1);
            printf("%s %s %s\n", strstr(text, "TETHER-SECRET") ? "LEAKED" : "READABLE", label, text);
            close(fd);
        }
        int main(void) {
            steal("tmp", "@TMP@");
            steal("root", "@ROOT@");
            steal("etc", "@ETC@");
            steal("shadow", "/etc/shadow");
            steal("public", "@PUBLIC@");
            int fd = open("@PUBLIC@", O_WRONLY | O_APPEND);
            if (fd >= 0) printf("LEAKED public writable\n");
            else printf("BLOCKED write public errno=%d\n", errno);
            if (chmod("@PUBLIC@", 0666) == 0) printf("LEAKED chmod\n"); else printf("BLOCKED chmod public\n");
            return 0;
        }
        """,
}


@pytest.mark.parametrize("language", ["python", "c"])
async def test_host_secret_files_stay_unreadable_and_unchanged(
    language: str, planted_secrets: PlantedSecrets
) -> None:
    paths = {label: str(path) for label, path in planted_secrets.paths.items()}
    before = planted_secrets.snapshot()
    code = program(
        SECRET_PROGRAMS[language],
        PATHS=json.dumps({**paths, "shadow": "/etc/shadow"}),
        TMP=paths["tmp"],
        ROOT=paths["root"],
        ETC=paths["etc"],
        PUBLIC=paths["public"],
    )
    async with open_sandbox(**(C_SPEC if language == "c" else {})) as sandbox:
        result = await sandbox.run(code, language)
    assert result.status is RunStatus.OK, describe(result)
    output = result.stdout + result.stderr
    assert "LEAKED" not in output, describe(result)
    for label in ("tmp", "root", "etc"):
        assert planted_secrets.contents[label] not in output
    # /tmp and /root are not in the root view at all; /etc is (read-only), so its 0600 file is only
    # refused by permissions: the host's root is no user inside the sandbox.
    expected = [
        f"BLOCKED read tmp errno={errno.ENOENT}",
        f"BLOCKED read root errno={errno.ENOENT}",
        f"BLOCKED read etc errno={errno.EACCES}",
        f"BLOCKED read shadow errno={errno.EACCES}",
        "READABLE public",
    ]
    if language == "python":
        # /root holds only what the Python prefixes need (here: pyenv), never the planted file.
        under_root = sorted(
            {p.split("/")[2] for p in PoolConfig().readonly_paths() if p.startswith("/root/")}
        )
        expected += [f"ROOT_LISTING {under_root}" if under_root else "ROOT_LISTING absent"]
        expected += ["SEARCHED secrets_found=0", "BLOCKED append public", "BLOCKED unlink public"]
        expected += ["BLOCKED chmod public", "BLOCKED rename public", "BLOCKED replace public"]
    else:
        expected += ["BLOCKED write public", "BLOCKED chmod public"]
    for marker in expected:
        assert marker in output, f"missing {marker!r}\n{describe(result)}"
    assert planted_secrets.snapshot() == before


async def test_host_environment_never_reaches_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = "TETHER-ENVSECR-"  # 15 characters: base64 of the prefix ends on a character boundary
    secret, control = (f"{prefix}{secrets.token_hex(8)}" for _ in range(2))
    monkeypatch.setenv("TETHER_TEST_SECRET", secret)  # before the pool starts its workers
    code = program(
        textwrap.dedent("""
        import os, sys
        kept = sys.stdin.read()  # positive control: the heap scan must find this one
        hits = [k for k, v in os.environ.items() if "TETHER" in k + v]
        print("LEAKED environ" if hits else "CLEAN environ", hits)
        for pid in [p for p in os.listdir("/proc") if p.isdigit()] + ["self"]:
            try:
                with open(f"/proc/{pid}/environ", "rb") as handle:
                    text = handle.read()
            except PermissionError:  # the run turned non-dumpable when it dropped to its uid
                text = b""
            print(f"LEAKED proc {pid}" if b"TETHER" in text else f"CLEAN proc {pid}")
        """)
        + HEAP_SCAN
        + 'print("HEAP", sorted(heap_tokens(b"@PREFIX@")))\n',
        PREFIX=prefix,
    )
    async with open_sandbox(memory_mib=128) as sandbox:
        result = await sandbox.run(code, stdin=control)
        shell = await sandbox.run(
            'env | grep -c TETHER; cat /proc/[0-9]*/environ | tr "\\0" "\\n" | grep -c TETHER; echo DONE',
            "bash",
        )
    assert result.status is RunStatus.OK, describe(result)
    assert "LEAKED" not in result.stdout, describe(result)
    for marker in ("CLEAN environ", "CLEAN proc 1", "CLEAN proc self", control):
        assert marker in result.stdout, f"missing {marker!r}\n{describe(result)}"
    assert secret[:-1] not in result.stdout + shell.stdout
    assert shell.stdout == "0\n0\nDONE\n", describe(shell)


# ---------------------------------------------------------------- processes


async def test_proc_shows_only_the_run_itself() -> None:
    code = program(
        """
        import os
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        print("PIDS", pids)
        for pid in pids:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if b"pytest" in handle.read():
                    print("LEAKED host command line", pid)
        print("HOST_PID", "LEAKED" if os.path.exists("/proc/@HOST_PID@/environ") else "ABSENT")
        print("PARENT", os.getppid())
        """,
        HOST_PID=os.getpid(),
    )
    async with open_sandbox() as sandbox:
        result = await sandbox.run(code)
    assert result.status is RunStatus.OK, describe(result)
    assert "LEAKED" not in result.stdout
    assert "PIDS [1]\n" in result.stdout and "PARENT 0\n" in result.stdout, describe(result)
    if os.getpid() > 1:
        assert "HOST_PID ABSENT" in result.stdout


async def test_killing_the_parent_reaches_nothing_outside_the_run() -> None:
    """kill(getppid()) is kill(0) in a PID namespace: it must not reach the host's process group."""
    attacker = program(
        """
        import os, signal, time
        child = os.fork()
        if child == 0:
            time.sleep(30)
            os._exit(0)
        print("PARENT", os.getppid(), flush=True)
        for label, target in [("parent", os.getppid()), ("group", 0), ("init", 1), ("everyone", -1),
                              ("host_pid", @HOST_PID@), ("host_group", -@HOST_PGID@)]:
            for number in (signal.SIGSTOP, signal.SIGKILL):
                try:
                    os.kill(target, number)
                    print("SENT", label, number.name, flush=True)
                except OSError as error:
                    print("REFUSED", label, number.name, error.errno, flush=True)
        _, status = os.waitpid(child, 0)
        print("OWN_CHILD_KILLED" if os.WIFSIGNALED(status) else "LEAKED child survived everything")
        print("ATTACKER_ALIVE")
        """,
        HOST_PID=os.getpid(),
        HOST_PGID=os.getpgid(0),
    )
    async with open_sandbox(slots=2, timeout_s=5) as sandbox:
        victim = asyncio.create_task(
            sandbox.pool.run(
                "import time\nprint('VICTIM_START', flush=True)\ntime.sleep(1.5)\nprint('VICTIM_DONE')"
            )
        )
        await asyncio.sleep(0.5)
        attack = await sandbox.pool.run(attacker)
        calm = await victim
        await sandbox.assert_host_clean()
        after = await sandbox.run("print('STILL_SERVING')")
        replaced = sandbox.pool.workers_replaced
    assert attack.qc is QcStatus.PASSED and calm.qc is QcStatus.PASSED
    assert attack.status is RunStatus.OK, describe(attack)
    for marker in ("PARENT 0", "SENT group SIGKILL", "OWN_CHILD_KILLED", "ATTACKER_ALIVE"):
        assert marker in attack.stdout, f"missing {marker!r}\n{describe(attack)}"
    assert "LEAKED" not in attack.stdout
    assert calm.status is RunStatus.OK and "VICTIM_DONE" in calm.stdout, describe(calm)
    assert calm.wall_ms < 3000, "the concurrent run was stopped by the attacker"
    assert after.stdout == "STILL_SERVING\n" and replaced == 0
    os.kill(os.getpid(), 0)  # the host test process is alive


BACKGROUND_PROGRAMS = {
    "python": """
        import os, subprocess
        writer = ("sleep 0.3; for d in /workspace /tmp /dev/shm @HOST_DIR@ /etc /root; "
                  "do echo @MARK@ > $d/@MARK@-$0; done")
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        subprocess.Popen(["nohup", "sh", "-c", writer, "nohup"], **quiet)
        subprocess.Popen(["setsid", "sh", "-c", writer, "setsid"], **quiet)
        subprocess.Popen(["sh", "-c", writer, "session"], start_new_session=True, **quiet)
        first = os.fork()
        if first == 0:
            os.setsid()
            if os.fork() == 0:
                os.execvp("sh", ["sh", "-c", writer, "daemon"])
            os._exit(0)
        os.waitpid(first, 0)
        print("SPAWNED 4")
        """,
    "bash": """
        dirs="/workspace /tmp /dev/shm @HOST_DIR@ /etc /root"
        writer="sleep 0.3; for d in $dirs; do echo @MARK@ > \\$d/@MARK@-\\$0; done"
        nohup sh -c "$writer" nohup >/dev/null 2>&1 &
        setsid sh -c "$writer" setsid >/dev/null 2>&1 &
        ( sh -c "$writer" subshell >/dev/null 2>&1 & ) &
        disown -a
        trap '' HUP TERM
        echo SPAWNED 3
        """,
    "c": r"""
        #define _GNU_SOURCE
        #include <stdio.h>
        #include <stdlib.h>
        #include <unistd.h>
        int main(void) {
            printf("SPAWNED 1\n");
            fflush(stdout);
            if (daemon(0, 0) != 0) return 1;
            usleep(300000);
            const char *dirs[] = {"/workspace", "/tmp", "/dev/shm", "@HOST_DIR@", "/etc", "/root", NULL};
            for (int i = 0; dirs[i]; i++) {
                char path[512];
                snprintf(path, sizeof path, "%s/@MARK@-daemon", dirs[i]);
                FILE *marker = fopen(path, "w");
                if (marker) { fputs("@MARK@", marker); fclose(marker); }
            }
            return 0;
        }
        """,
}


@pytest.mark.parametrize("language", ["python", "bash", "c"])
async def test_background_processes_die_with_the_run(language: str, tmp_path: Path) -> None:
    mark = f"{ESCAPE_NAME}-bg"
    code = program(BACKGROUND_PROGRAMS[language], MARK=mark, HOST_DIR=tmp_path)
    async with open_sandbox(timeout_s=5, **(C_SPEC if language == "c" else {})) as sandbox:
        result = await sandbox.run(code, language)  # asserts no run process survives on the host
        await asyncio.sleep(0.6)  # twice the writers' delay
        await sandbox.assert_host_clean()
        later = await sandbox.run(
            program(
                """
                import glob
                found = [p for d in ("/workspace", "/tmp", "/dev/shm") for p in glob.glob(d + "/@MARK@*")]
                print("LEAKED markers", found) if found else print("NO_MARKERS")
                """,
                MARK=mark,
            )
        )
    assert result.status is RunStatus.OK, describe(result)
    assert "SPAWNED" in result.stdout
    assert result.wall_ms < 3000, "the run waited for its background processes"
    assert later.stdout == "NO_MARKERS\n", describe(later)
    assert not list(tmp_path.glob(f"{mark}*"))
    assert host_escape_files() == []


# ---------------------------------------------------------------- other runs


async def test_concurrent_run_cannot_find_another_runs_files() -> None:
    secret = f"TETHER-CONCURRENT-{secrets.token_hex(8)}"
    owner = program(
        """
        import socket, time
        for path in ("/workspace/concurrent-secret", "/tmp/concurrent-secret", "/dev/shm/concurrent-secret",
                     "/mnt/concurrent-secret"):
            with open(path, "w") as handle:
                handle.write("@SECRET@")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\\0tether-concurrent-@TOKEN@")
        listener.listen()
        print("WRITTEN", flush=True)
        time.sleep(2)
        """,
        SECRET=secret,
        TOKEN=TOKEN,
    )
    searcher = program(
        """
        import os, re, socket
        pattern, files, found = re.compile(rb"TETHER-CONCURRENT-[0-9a-f]{16}"), 0, []
        for top in ("/",):
            for directory, subdirectories, names in os.walk(top):
                if directory in ("/proc", "/usr"):
                    subdirectories.clear()
                    continue
                for name in names:
                    files += 1
                    path = os.path.join(directory, name)
                    if "concurrent-secret" in name:
                        found.append(path)
                    # Contents of every writable file: read-only re-binds (a checkout under /tmp) hold no
                    # run's data and may be large.
                    writable = not os.statvfs(directory).f_flag & os.ST_RDONLY
                    if writable and directory.startswith(("/workspace", "/tmp", "/dev/shm", "/mnt")):
                        with open(path, "rb") as handle:
                            found += [m.decode() for m in pattern.findall(handle.read())]
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            refused = sock.connect_ex("\\0tether-concurrent-@TOKEN@")
        print("LEAKED", found) if found else print(f"SEARCHED files={files}")
        print("LEAKED socket") if refused == 0 else print("BLOCKED abstract socket")
        print("PIDS", pids)
        """,
        TOKEN=TOKEN,
    )
    # The search walks every visible file (tens of thousands in the read-only venv): on a loaded 2-core
    # machine that took more than 8 s, so the limit is generous; isolation, not speed, is under test.
    async with open_sandbox(slots=2, timeout_s=30) as sandbox:
        holding = asyncio.create_task(sandbox.pool.run(owner))
        await asyncio.sleep(0.5)
        search = await sandbox.pool.run(searcher)
        held = await holding
        await sandbox.assert_host_clean()
    assert held.status is RunStatus.OK and held.stdout == "WRITTEN\n", describe(held)
    assert search.status is RunStatus.OK, describe(search)
    assert "LEAKED" not in search.stdout and secret not in search.stdout, describe(search)
    files = int(re.findall(r"SEARCHED files=(\d+)", search.stdout)[0])
    assert files > 100, "the search did not look through the filesystem"
    assert "BLOCKED abstract socket" in search.stdout and "PIDS ['1']" in search.stdout
    assert search.qc is QcStatus.PASSED and held.qc is QcStatus.PASSED


async def test_nothing_of_a_run_is_left_for_the_next() -> None:
    prefix = "TETHER-RESIDUE-"
    residue, control = (f"{prefix}{secrets.token_hex(8)}" for _ in range(2))
    polluter = program(
        """
        import builtins, ctypes, json, os, socket, sys
        libc = ctypes.CDLL(None, use_errno=True)
        text = sys.stdin.read() + open("given.txt").read()
        print(text)  # the token reaches stdout too
        for path in ("/workspace/left", "/tmp/left", "/dev/shm/left", "/mnt/left"):
            with open(path, "w") as handle:
                handle.write(text)
        print("CREATED files")
        for label, result in [("shm", libc.shmget(0x7E7E01, 4096, 0o1666)),
                              ("msg", libc.msgget(0x7E7E02, 0o1666)),
                              ("sem", libc.semget(0x7E7E03, 1, 0o1666)),
                              ("mq", libc.mq_open(b"/tether-left", os.O_CREAT | os.O_RDWR, 0o666, None))]:
            print(f"CREATED {label}" if result >= 0 else f"FAILED {label} errno={ctypes.get_errno()}")
        abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        abstract.bind("\\0tether-left-@TOKEN@")
        abstract.listen()
        tcp = socket.create_server(("127.0.0.1", 47001))
        print("CREATED sockets")
        os.environ["TETHER_LEFT"] = "1"
        os.putenv("TETHER_LEFT_PUT", "1")
        json.dumps = lambda *args, **kwargs: "POLLUTED"
        builtins.tether_left = True
        os.umask(0)
        print("CREATED process state", flush=True)
        """,
        TOKEN=TOKEN,
    )
    checker = program(
        textwrap.dedent("""
        import builtins, ctypes, json, os, socket, sys
        libc = ctypes.CDLL(None, use_errno=True)
        kept = sys.stdin.read()
        left = [p for p in ("/workspace/left", "/tmp/left", "/dev/shm/left", "/mnt/left",
                            "/workspace/given.txt") if os.path.exists(p)]
        print("POLLUTED files", left) if left else print("CLEAN files")
        for label, result in [("shm", libc.shmget(0x7E7E01, 0, 0)), ("msg", libc.msgget(0x7E7E02, 0)),
                              ("sem", libc.semget(0x7E7E03, 0, 0)),
                              ("mq", libc.mq_open(b"/tether-left", os.O_RDONLY))]:
            print(f"POLLUTED {label}" if result >= 0 else f"CLEAN {label}")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            print("CLEAN abstract" if sock.connect_ex("\\0tether-left-@TOKEN@") else "POLLUTED abstract")
        with socket.socket() as sock:
            print("CLEAN tcp" if sock.connect_ex(("127.0.0.1", 47001)) else "POLLUTED tcp")
        env = [k for k in os.environ if k.startswith("TETHER")]
        print("POLLUTED env", env) if env else print("CLEAN env")
        pristine = json.dumps({}) == "{}" and not hasattr(builtins, "tether_left")
        print("CLEAN modules" if pristine else "POLLUTED modules")
        print("CLEAN umask" if os.umask(0o022) == 0o022 else "POLLUTED umask")
        print("CLEAN cwd" if os.getcwd() == "/workspace" else "POLLUTED cwd")
        """)
        + HEAP_SCAN
        + 'print("HEAP", sorted(heap_tokens(b"@PREFIX@")))\n',
        TOKEN=TOKEN,
        PREFIX=prefix,
    )
    spec = sandbox_spec(memory_mib=128, env={"GIVEN": residue})
    async with open_sandbox(memory_mib=128) as sandbox:
        first = await sandbox.run(polluter, stdin=residue + "\n", files={"given.txt": residue}, spec=spec)
        second = await sandbox.run(checker, stdin=control)
        assert first.worker == second.worker
    assert first.status is RunStatus.OK, describe(first)
    for marker in (
        "CREATED files",
        "CREATED shm",
        "CREATED msg",
        "CREATED sem",
        "CREATED mq",
        "CREATED sockets",
    ):
        assert marker in first.stdout, f"missing {marker!r}\n{describe(first)}"
    assert second.status is RunStatus.OK, describe(second)
    assert "POLLUTED" not in second.stdout, describe(second)
    for item in ("files", "shm", "msg", "sem", "mq", "abstract", "tcp", "env", "modules", "umask", "cwd"):
        assert f"CLEAN {item}" in second.stdout, f"missing CLEAN {item}\n{describe(second)}"
    # The heap scan finds the checker's own stdin, so it would find the polluter's had it survived.
    assert control in second.stdout, describe(second)
    assert residue[:-1] not in second.stdout, "the previous run's data is in the next run's memory"


# ---------------------------------------------------------------- files in and out


@pytest.mark.parametrize("root", [".", "/workspace", "/tmp", "/mnt", "/dev/shm"])
async def test_collected_symlinks_do_not_leak_host_files(
    planted_secrets: PlantedSecrets, monkeypatch: pytest.MonkeyPatch, root: str
) -> None:
    """Links planted in any writable root, collected by relative or absolute path, never reach the host."""
    env_secret = f"TETHER-SECRET-{secrets.token_hex(8)}"
    monkeypatch.setenv("TETHER_TEST_SECRET", env_secret)
    etc_secret = planted_secrets.paths["etc"]
    code = program(
        """
        import os
        os.chdir("@ROOT@")
        links = {"shadow": "/etc/shadow", "secret": "@ETC_SECRET@", "etc": "/etc", "up": "../../../..",
                 "proc": "/proc", "staging": "/.staging", "root": "/", "loop": "loop"}
        for name, target in links.items():
            os.symlink(target, name)
        os.mkfifo("fifo")
        print("LINKED", len(links))
        """,
        ETC_SECRET=etc_secret,
        ROOT=root,
    )
    names = [
        "shadow",
        "secret",
        f"etc/{etc_secret.name}",
        "etc/shadow",
        "etc/passwd",
        "up/etc/passwd",
        f"up/etc/{etc_secret.name}",
        f"root/etc/{etc_secret.name}",
        "proc/1/environ",
        "proc/self/environ",
        "staging",
        "loop",
        "fifo",
    ]
    collect = names if root == "." else [f"{root}/{name}" for name in names]
    async with open_sandbox() as sandbox:
        result = await sandbox.run(code, collect=collect)
    assert result.status is RunStatus.OK and "LINKED 8" in result.stdout, describe(result)
    collected = b"".join(base64.b64decode(data) for data in result.files.values()).decode(errors="replace")
    for secret in (*planted_secrets.contents.values(), env_secret):
        if secret != planted_secrets.contents["public"]:
            assert secret not in collected
    # Only files inside the run's own roots come back: not even world-readable host files through a link.
    assert result.files == {}, sorted(result.files)
    assert sorted(result.missing_files) == sorted(collect)


@pytest.mark.parametrize(
    "name",
    [
        f"../{ESCAPE_NAME}",
        f"sub/../../{ESCAPE_NAME}",
        f"a/b/../../../../../../etc/{ESCAPE_NAME}",
        f"/etc/{ESCAPE_NAME}",
        f"/tmp/../etc/{ESCAPE_NAME}",
        f"/mnt/../../etc/{ESCAPE_NAME}",
        f"/workspace/../{ESCAPE_NAME}",
        f"//tmp/{ESCAPE_NAME}",
        f"/proc/self/{ESCAPE_NAME}",
        f"/.staging/{ESCAPE_NAME}",
        f"/.program/{ESCAPE_NAME}",
        f"/dev/{ESCAPE_NAME}",
        "/tmp",
    ],
)
async def test_uploaded_files_cannot_escape_the_writable_roots(name: str) -> None:
    async with open_sandbox() as sandbox:
        with pytest.raises(ConfigError) as refused:
            await sandbox.pool.run("print('NEVER_RUN')", files={name: "pwned"})
        # The pool refuses before a worker sees the request; the worker refuses on its own as well.
        request, compiled = sandbox.pool.build_request(
            "print('NEVER_RUN')", "python", "", {}, sandbox.pool.spec
        )
        request.files[name] = base64.b64encode(b"pwned").decode()
        worker = sandbox.pool._idle.pop()
        try:
            result, healthy = await sandbox.pool.execute(worker, request, sandbox.pool.spec, compiled)
        finally:
            sandbox.pool._idle.append(worker)
        await sandbox.assert_host_clean()
        after = await sandbox.run(
            "import os\nprint(sorted(os.listdir('/workspace')), sorted(os.listdir('/tmp')))"
        )
        assert sandbox.pool.workers_replaced == 0
    assert repr(name) in str(refused.value) and "working directory" in str(refused.value)
    assert healthy and result.qc is QcStatus.PASSED, describe(result)
    assert result.status is RunStatus.SANDBOX_ERROR, describe(result)
    assert "NEVER_RUN" not in result.stdout
    assert result.error is not None and repr(name) in result.error, result.error
    assert "working directory" in result.error
    assert after.stdout == f"['main.py'] {covered_tmp_entries(sandbox.pool)}\n", describe(after)
    assert host_escape_files(("/tmp",)) == []


@pytest.mark.parametrize(
    "name",
    [
        "staging/owned",
        "up/owned",
        "zygote/comm",
        "file_link",
        "/workspace/up/owned",
        "/tmp/staging/owned",
        "/tmp/up/owned",
        "/mnt/zygote/comm",
        "/mnt/file_link",
        "/dev/shm/up/owned",
    ],
)
async def test_session_upload_does_not_follow_symlinks_a_run_planted(name: str) -> None:
    """Between a session's runs the zygote, the namespace root, writes files into the run's roots."""
    plant = """
        import os
        links = {"staging": "/.staging", "zygote": "/proc/1", "up": "../../..",
                 "file_link": "/.staging/owned"}
        for root in ("/workspace", "/tmp", "/mnt", "/dev/shm"):
            for link, target in links.items():
                os.symlink(target, f"{root}/{link}")
        print("PLANTED")
        """
    async with open_sandbox() as sandbox:
        async with await sandbox.pool.open_session() as session:
            planted = await session.run(program(plant))
            assert planted.stdout == "PLANTED\n", describe(planted)
            with pytest.raises(TetherError, match="upload to session"):
                await session.upload({name: b"pwned"})
            with pytest.raises(FileNotFoundError):
                await session.download(["staging/owned", "zygote/environ", "up/etc/passwd"])
            with pytest.raises(FileNotFoundError):
                await session.download(
                    ["/tmp/staging/owned", "/mnt/zygote/environ", "/dev/shm/up/etc/passwd"]
                )
            # The worker's own view, seen from the host: its staging area is still the zygote's alone.
            zygote = min(sandbox_processes())
            staging = os.stat(f"/proc/{zygote}/root/.staging")
            assert (staging.st_uid, stat.S_IMODE(staging.st_mode)) == (UID_BASE, 0o700)
            assert "owned" not in os.listdir(f"/proc/{zygote}/root/.staging")
            assert Path(f"/proc/{zygote}/comm").read_text() != "pwned"
        after = await sandbox.run(
            "import os\nprint(os.stat('/.staging').st_uid, os.access('/.staging', os.R_OK))"
        )
    assert after.stdout == "0 False\n", describe(after)
