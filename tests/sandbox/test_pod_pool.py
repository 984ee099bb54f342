"""The pool in a non-privileged pod: host ids below 65536 inside a user namespace, and a read-only cgroup
tree, which `insecure` turns into a pool without per-run cgroups (and which is refused without it).

The pod is emulated by `pods.run_in_pod`: ids 0-65535 only, as a `hostUsers: false` pod has, and every
cgroup mount read-only."""

from __future__ import annotations

import json

import pytest

from tether.errors import ConfigError
from tether.sandbox.pool_config import PoolConfig, unprivileged_id_floor

from .pods import run_in_pod

_POOL = """
import asyncio, json
from tether.sandbox.pool import SandboxPool, SandboxUnavailable
from tether.sandbox.pool_config import PoolConfig
from tether.sandbox.spec import SandboxSpec

async def main():
    config = PoolConfig(slots=1, host_uid_base=60000, insecure=sys.argv[1] == "insecure")
    try:
        async with SandboxPool(SandboxSpec(timeout_s=10), config) as pool:
            result = await pool.run("import os; print(os.getuid(), 6 * 7)")
            cgroups = pool.layout is not None
            return {"status": result.status.value, "stdout": result.stdout, "cgroups": cgroups}
    except SandboxUnavailable as error:
        return {"refused": str(error)}

print(json.dumps(asyncio.run(main())))
"""


def _pool_in_a_pod(mode: str) -> dict[str, object]:
    answer: dict[str, object] = json.loads(run_in_pod(_POOL, mode, read_only_cgroups=True))
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
