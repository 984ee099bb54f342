"""The pool in a non-privileged pod: host ids below 65536 inside a user namespace, and a read-only cgroup
tree, which `insecure` turns into a pool without per-run cgroups (and which is refused without it).

The pod is emulated as `tests/sandbox/test_doctor.py` does: a child in its own user namespace that maps
only ids 0-65535 (as a `hostUsers: false` pod does), with every cgroup mount remounted read-only."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tether.errors import ConfigError
from tether.sandbox.pool_config import PoolConfig, unprivileged_id_floor

_POOL_IN_A_POD = """
import asyncio, json, os, sys, time
from tether.sandbox import linux
from tether.sandbox.linux import Clone, Mount
insecure = sys.argv[1] == "insecure"
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    linux.unshare(Clone.NEWUSER | Clone.NEWNS)
    if not os.read(read, 1):
        os._exit(1)
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    linux.mount("none", "/", None, Mount.REC | Mount.PRIVATE)
    for point in [line.split()[4] for line in open("/proc/self/mountinfo") if " - cgroup" in line]:
        linux.mount(point, point, None, Mount.BIND)
        flags = linux.locked_mount_flags(point) | Mount.RDONLY
        linux.mount("none", point, None, Mount.REMOUNT | Mount.BIND | flags)
    from tether.sandbox.pool import SandboxPool, SandboxUnavailable
    from tether.sandbox.pool_config import PoolConfig
    from tether.sandbox.spec import SandboxSpec

    async def main():
        config = PoolConfig(slots=1, host_uid_base=60000, insecure=insecure)
        try:
            async with SandboxPool(SandboxSpec(timeout_s=10), config) as pool:
                result = await pool.run("import os; print(os.getuid(), 6 * 7)")
                cgroups = pool.layout is not None
                return {"status": result.status.value, "stdout": result.stdout, "cgroups": cgroups}
        except SandboxUnavailable as error:
            return {"refused": str(error)}

    print(json.dumps(asyncio.run(main())), flush=True)
    os._exit(0)
time.sleep(0.2)
try:
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as handle:
            handle.write("0 0 65536\\n")
    os.write(write, b"x")
finally:
    os.close(write)
    os.waitpid(pid, 0)
"""


def _pool_in_a_pod(mode: str) -> dict[str, object]:
    completed = subprocess.run(
        [sys.executable, "-c", _POOL_IN_A_POD, mode], capture_output=True, text=True, timeout=120, check=True
    )
    assert completed.stdout, completed.stderr
    answer: dict[str, object] = json.loads(completed.stdout.splitlines()[-1])
    return answer


def test_in_a_pod_with_read_only_cgroups_an_insecure_pool_runs_without_them_on_pod_sized_ids() -> None:
    answer = _pool_in_a_pod("insecure")
    assert answer == {"status": "ok", "stdout": "1000 42\n", "cgroups": False}


def test_in_a_pod_with_read_only_cgroups_a_secure_pool_refuses_to_start_naming_them() -> None:
    refused = str(_pool_in_a_pod("secure")["refused"])
    assert "cannot hold per-run groups" in refused and "Read-only file system" in refused
    assert "--insecure" in refused


@pytest.mark.parametrize(
    ("uid_map", "floor"),
    [
        ("         0          0 4294967295\n", 65536),  # the initial namespace
        ("0 833617920 65536\n", 1),  # a hostUsers: false pod
        ("0 1000 1\n", 1),
    ],
)
def test_the_host_id_floor_is_strict_only_outside_a_user_namespace(uid_map: str, floor: int) -> None:
    assert unprivileged_id_floor(uid_map) == floor


def test_outside_a_user_namespace_host_ids_below_65536_are_refused_naming_the_floor() -> None:
    with pytest.raises(ConfigError, match=r"host_uid_base = 60000: must be at least 65536 outside a user"):
        PoolConfig(host_uid_base=60000)
