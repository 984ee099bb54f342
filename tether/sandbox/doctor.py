"""`tether sandbox doctor`: which isolation primitives this kernel offers, each probed for real.

Every probe runs in a throwaway child process, so a failed probe cannot disturb the caller. The
sandbox needs all of them; `SandboxPool` refuses to start without them unless `insecure=True`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from tether.sandbox.cgroups import system_layout
from tether.sandbox.linux import Clone


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True


_UNSHARE_PROBE = """
import sys
from tether.sandbox import linux
linux.unshare(int(sys.argv[1]))
"""

_SECCOMP_PROBE = """
import errno
from tether.sandbox import linux
from tether.sandbox.seccomp import build_filter
build_filter().load()
try:
    linux.unshare(linux.Clone.NEWNS)
except OSError as error:
    raise SystemExit(0 if error.errno == errno.EPERM else 3)
raise SystemExit(4)
"""


def _probe(code: str, *args: str) -> tuple[bool, str]:
    completed = subprocess.run(
        [sys.executable, "-I", "-c", code, *args], capture_output=True, text=True, timeout=30, check=False
    )
    if completed.returncode == 0:
        return True, "available"
    lines = completed.stderr.strip().splitlines()
    return False, lines[-1] if lines else f"exit code {completed.returncode}"


def run_checks() -> list[Check]:
    checks = []
    for name, flag in (
        ("user namespace", Clone.NEWUSER),
        ("pid namespace", Clone.NEWPID),
        ("network namespace", Clone.NEWNET),
        ("mount namespace", Clone.NEWNS),
        ("ipc namespace", Clone.NEWIPC),
        ("uts namespace", Clone.NEWUTS),
    ):
        ok, detail = _probe(_UNSHARE_PROBE, str(int(flag)))
        checks.append(Check(name, ok, detail))
    layout = system_layout()
    if layout is None:
        checks.append(
            Check(
                "cgroups (memory, pids, cpu)",
                False,
                "no v1 hierarchy or v2 subtree offers memory, pids and cpu",
            )
        )
    else:
        detail = f"v{layout.version.value}: " + ", ".join(f"{c}={p}" for c, p in sorted(layout.bases.items()))
        writable = all(os.access(path.parent, os.W_OK) for path in layout.directories)
        checks.append(
            Check(
                "cgroups (memory, pids, cpu)",
                writable,
                detail if writable else f"{detail} (not writable by this user)",
            )
        )
    ok, detail = _probe(_SECCOMP_PROBE)
    checks.append(Check("seccomp filter", ok, "filter loads and refuses unshare" if ok else detail))
    checks.append(
        Check(
            "running as root",
            os.geteuid() == 0,
            "yes" if os.geteuid() == 0 else "uid/gid maps and cgroups need root",
        )
    )
    return checks
