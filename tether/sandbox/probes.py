"""The real probes behind `tether sandbox doctor`: each primitive tried the way the sandbox uses it.

Every probe that changes process state runs in a throwaway child (`python -I -c ...`) that reports one
JSON line, so a failed or half-done probe cannot disturb the caller; namespaces are always taken with
a new user namespace, as the workers take them, so a pod's missing capability is not mistaken for a
missing kernel feature. The cgroup probe creates, fills and removes one group the way a run's is, under
the pool's own `tether` group (which it creates, as a starting pool would). What the results mean is
decided by `doctor.diagnose`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tether.sandbox import linux
from tether.sandbox.doctor import (
    Environment,
    Primitive,
    Probe,
    detect_environment,
    missing_capabilities,
    unmapped,
)
from tether.sandbox.linux import Clone
from tether.sandbox.worker import IdMap

_TIMEOUT_S = 30
_PRELUDE = """
import errno, json, os, sys
from tether.sandbox import linux
from tether.sandbox.linux import Clone, Mount

def report(ok, detail, code=None, stage=""):
    print(json.dumps({"ok": ok, "detail": detail, "errno": code, "stage": stage}), flush=True)
    os._exit(0)
"""

_UNSHARE = """
try:
    linux.unshare(int(sys.argv[1]))
except OSError as error:
    report(False, str(error), error.errno)
report(True, "available")
"""

_MOUNT = """
tmpfs_dir, bind_dir = sys.argv[1], sys.argv[2]
try:
    linux.unshare(Clone.NEWUSER | Clone.NEWNS)
    linux.mount("none", "/", None, Mount.REC | Mount.PRIVATE)
    linux.mount("tmpfs", tmpfs_dir, "tmpfs", Mount.NOSUID | Mount.NODEV, "size=1m")
    linux.mount("/usr", bind_dir, None, Mount.BIND | Mount.REC)
    flags = linux.locked_mount_flags(bind_dir) | Mount.RDONLY | Mount.NOSUID
    linux.mount("none", bind_dir, None, Mount.REMOUNT | Mount.BIND | flags)
except OSError as error:
    report(False, str(error), error.errno)
report(True, "tmpfs and read-only bind mounts work")
"""

# A new /proc needs a PID namespace of its own, which only a child of the unsharing process enters.
_PROC = """
try:
    linux.unshare(Clone.NEWUSER | Clone.NEWNS | Clone.NEWPID)
    linux.mount("none", "/", None, Mount.REC | Mount.PRIVATE)
except OSError as error:
    report(False, str(error), error.errno)
pid = os.fork()
if pid == 0:
    try:
        linux.mount("proc", sys.argv[1], "proc", Mount.NOSUID | Mount.NODEV | Mount.NOEXEC)
    except OSError as error:
        os._exit(error.errno)
    os._exit(0)
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
if code:
    report(False, f"mount proc: {os.strerror(code)}", code)
report(True, "a PID namespace's own /proc mounts")
"""

# Stops after unsharing, until the parent has written its id maps (as a worker's launcher does).
_ID_MAP = """
try:
    linux.unshare(Clone.NEWUSER)
except OSError as error:
    report(False, str(error), error.errno)
print("unshared", flush=True)
sys.stdin.readline()
try:
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
except OSError as error:
    report(False, f"becoming the namespace's root after the maps were written: {error}", error.errno)
report(True, sys.argv[1])
"""

_CGROUPS = """
from tether.sandbox import cgroups
layout = cgroups.system_layout()
if layout is None:
    report(False, "no v1 hierarchy or v2 subtree offers memory, pids and cpu", None, "layout")
detail = f"v{layout.version.value}: " + ", ".join(f"{c}={p}" for c, p in sorted(layout.bases.items()))
stage, group = "prepare", None
try:
    cgroups.prepare_layout(layout)
    stage = "create"
    group = cgroups.RunCgroup(layout, f"doctor-{os.getpid()}")
    group.create(cgroups.CgroupLimits(64 * 1024 * 1024, 16, 0.5))
    stage = "stats"
    group.stats()
except OSError as error:
    own = layout.directories[0].parent
    v2 = layout.version is cgroups.CgroupVersion.V2
    if stage == "prepare" and v2 and (own / "cgroup.procs").read_text().split():
        stage = "internal-process"
        error = OSError(error.errno, f"{own} holds processes, so it can give {own}/tether no controllers")
    report(False, f"{detail}: {stage}: {error}", error.errno, stage)
finally:
    if group is not None:
        group.remove()
report(True, detail + " (a run's group created, limited, read and removed)")
"""

_SECCOMP = """
from tether.sandbox.seccomp import build_filter
try:
    build_filter().load()
except Exception as error:
    report(False, f"{type(error).__name__}: {error}")
try:
    linux.unshare(Clone.NEWNS)
except OSError as error:
    if error.errno == errno.EPERM:
        report(True, "filter loads and refuses unshare")
    report(False, f"unshare under the filter failed with {error}, not EPERM", error.errno)
report(False, "the filter loaded but let unshare through")
"""


def _parse(primitive: Primitive, completed: subprocess.CompletedProcess[str]) -> Probe:
    lines = completed.stdout.strip().splitlines()
    try:
        reply = json.loads(lines[-1])
    except (IndexError, ValueError):
        errors = completed.stderr.strip().splitlines()
        return Probe(primitive, False, errors[-1] if errors else f"probe exited with {completed.returncode}")
    return Probe(primitive, bool(reply["ok"]), str(reply["detail"]), reply["errno"], str(reply["stage"]))


def _child(primitive: Primitive, code: str, *args: str) -> Probe:
    command = [sys.executable, "-I", "-c", _PRELUDE + code, *args]
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return Probe(primitive, False, f"the probe did not finish within {_TIMEOUT_S} s")
    return _parse(primitive, completed)


def probe_namespaces() -> list[Probe]:
    probes = [_child(Primitive.USER_NAMESPACE, _UNSHARE, str(int(Clone.NEWUSER)))]
    for primitive, flag in (
        (Primitive.PID_NAMESPACE, Clone.NEWPID),
        (Primitive.NETWORK_NAMESPACE, Clone.NEWNET),
        (Primitive.IPC_NAMESPACE, Clone.NEWIPC),
        (Primitive.UTS_NAMESPACE, Clone.NEWUTS),
    ):
        probes.append(_child(primitive, _UNSHARE, str(int(Clone.NEWUSER | flag))))
    with tempfile.TemporaryDirectory(prefix="tether-doctor-") as scratch:
        for name in ("tmpfs", "bind", "proc"):
            os.mkdir(f"{scratch}/{name}")
        probes.append(_child(Primitive.MOUNT_NAMESPACE, _MOUNT, f"{scratch}/tmpfs", f"{scratch}/bind"))
        probes.append(_child(Primitive.PROC, _PROC, f"{scratch}/proc"))
    return probes


def probe_id_map(ids: IdMap) -> Probe:
    """Write a worker's uid and gid maps onto a child that has just unshared its user namespace.

    The kernel answers EPERM both for a missing capability and for ids this namespace lacks; the
    latter is told apart (stage "unmapped") from this namespace's own map.
    """
    probe = _write_id_map(ids)
    if not probe.ok:
        outside = unmapped([ids.host_base, ids.host_base + ids.run_id], _read("/proc/self/uid_map"))
        if outside:
            return Probe(
                Primitive.ID_MAP, False, f"host ids {', '.join(map(str, outside))}", probe.errno, "unmapped"
            )
    return probe


def _write_id_map(ids: IdMap) -> Probe:
    wanted = [ids.host_base, ids.host_base + ids.run_id]
    described = f"host ids {wanted[0]} and {wanted[1]}"
    command = [
        sys.executable,
        "-I",
        "-c",
        _PRELUDE + _ID_MAP,
        f"{described} mapped to the worker's root and run user",
    ]
    child = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        first = child.stdout.readline()
        if first.strip() != "unshared":
            child.stdin.close()
            return _parse(
                Primitive.ID_MAP, subprocess.CompletedProcess(command, child.wait(_TIMEOUT_S), first, "")
            )
        try:
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{child.pid}/{name}", "w") as handle:
                    handle.write(ids.lines())
        except OSError as error:
            return Probe(Primitive.ID_MAP, False, described, error.errno)
        child.stdin.write("\n")
        child.stdin.close()
        rest = child.stdout.read()
        return _parse(
            Primitive.ID_MAP, subprocess.CompletedProcess(command, child.wait(_TIMEOUT_S), rest, "")
        )
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for stream in (child.stdout, child.stderr):
            if stream is not None:
                stream.close()


def probe_capabilities() -> Probe:
    status = Path("/proc/self/status").read_text()
    cap_eff = next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff:"))
    missing = missing_capabilities(cap_eff)
    if missing:
        return Probe(Primitive.CAPABILITIES, False, ", ".join(missing))
    return Probe(Primitive.CAPABILITIES, True, "SETUID, SETGID and KILL")


def probe_all(ids: IdMap) -> list[Probe]:
    probes = probe_namespaces()
    probes.insert(1, probe_id_map(ids))
    probes.append(_child(Primitive.CGROUPS, _CGROUPS))
    probes.append(_child(Primitive.SECCOMP, _SECCOMP))
    root = os.geteuid() == 0
    probes.append(Probe(Primitive.ROOT, root, "yes" if root else f"euid {os.geteuid()}"))
    probes.append(probe_capabilities())
    return probes


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def current_environment() -> Environment:
    return detect_environment(
        os.environ,
        _read("/proc/1/cgroup"),
        os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"),
        _read("/proc/version"),
        linux.read_kernel_log(),
        _read("/proc/self/uid_map"),
    )
