"""A non-privileged Kubernetes pod, emulated on this machine for sandbox tests.

A child process in its own user namespace that maps only ids 0-65535 (onto the same ids, so files stay
readable), as a `hostUsers: false` pod's does; optionally with every cgroup mount read-only and
`/proc/keys` masked, as a container runtime without privileges leaves them. The Python `body` runs
there as root of that namespace and prints what the test reads (its last line of output).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = """
import os, sys, time
from tether.sandbox import linux
from tether.sandbox.linux import Clone, Mount
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    linux.unshare(Clone.NEWUSER | Clone.NEWNS)
    if not os.read(read, 1):  # the parent died before writing the maps
        os._exit(1)
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
{container}{body}
    sys.stdout.flush()
    os._exit(0)
time.sleep(0.2)
try:
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{{pid}}/{{name}}", "w") as handle:
            handle.write("0 0 65536\\n")
    os.write(write, b"x")
finally:
    os.close(write)
    os.waitpid(pid, 0)
"""

_READ_ONLY_CGROUPS = """
linux.mount("none", "/", None, Mount.REC | Mount.PRIVATE)
for point in [line.split()[4] for line in open("/proc/self/mountinfo") if " - cgroup" in line]:
    linux.mount(point, point, None, Mount.BIND)
    flags = linux.locked_mount_flags(point) | Mount.RDONLY
    linux.mount("none", point, None, Mount.REMOUNT | Mount.BIND | flags)
"""

_MASKED_PROC = """
linux.mount("/dev/null", "/proc/keys", None, Mount.BIND)
os.environ["KUBERNETES_SERVICE_HOST"] = "10.0.0.1"
"""


def run_in_pod(
    body: str, *args: str, read_only_cgroups: bool = False, masked_proc: bool = False, timeout_s: float = 120
) -> str:
    """`body`'s last line of output, run in the emulated pod (`sys.argv[1:]` is `args`)."""
    container = (_READ_ONLY_CGROUPS if read_only_cgroups else "") + (_MASKED_PROC if masked_proc else "")
    script = _SCRIPT.format(
        container=textwrap.indent(container, "    "), body=textwrap.indent(textwrap.dedent(body), "    ")
    )
    completed = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout_s, check=True
    )
    assert completed.stdout, completed.stderr
    return completed.stdout.splitlines()[-1]
