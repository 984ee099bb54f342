"""A run's cgroup is recycled for the next run only as new: empty, its OOM kills and peak its own."""

from __future__ import annotations

import os

from tether.sandbox import PoolConfig, RunStatus, SandboxPool, SandboxSpec

HOG = "chunks = []\nwhile True:\n    chunks.append(bytearray(8 << 20))"


async def test_the_run_after_an_oom_kill_in_a_recycled_group_is_ok_with_its_own_peak() -> None:
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1)) as pool:
        killed = await pool.run(HOG, spec=SandboxSpec(memory_mib=64))
        assert killed.status is RunStatus.MEMORY_LIMIT and killed.qc == "passed"
        if pool.layout is None or not pool._cgroups:  # v2 or no cgroups: nothing is recycled
            return
        (recycled,) = pool._cgroups
        after = await pool.run("print(1)")
        assert after.status is RunStatus.OK and after.stdout == "1\n"
        assert after.peak_memory_kib < 16 * 1024, "the peak counted the earlier run's memory"
        assert pool._cgroups == [recycled]


async def test_a_recycled_group_takes_the_limits_of_the_next_run() -> None:
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1)) as pool:
        assert (await pool.run("print(1)", spec=SandboxSpec(memory_mib=64))).status is RunStatus.OK
        roomy = await pool.run(
            "x = bytearray(100 << 20)\nprint(len(x) >> 20)", spec=SandboxSpec(memory_mib=256)
        )
        assert roomy.status is RunStatus.OK and roomy.stdout == "100\n"
        tight = await pool.run(HOG, spec=SandboxSpec(memory_mib=64))
        assert tight.status is RunStatus.MEMORY_LIMIT


def _procs_descriptors() -> list[str]:
    """This process's open descriptors on a `cgroup.procs` file."""
    targets = []
    for name in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            continue
    return [target for target in targets if target.endswith("/cgroup.procs")]


async def test_a_recycled_group_hands_every_run_the_same_descriptors_and_closing_frees_them() -> None:
    # The group opens its `cgroup.procs` once and keeps it until removed: many runs must not add a
    # descriptor per run (a leak), each run must still join the group, and closing the pool closes all.
    before = _procs_descriptors()
    async with SandboxPool(SandboxSpec(timeout_s=10), PoolConfig(slots=1)) as pool:
        code = "print(open('/proc/self/cgroup').read())"
        runs = [await pool.run(code) for _ in range(5)]
        assert all(run.status is RunStatus.OK and run.qc == "passed" for run in runs), runs
        if pool.layout is None:
            return
        held = len(_procs_descriptors()) - len(before)
        assert held == len(pool.layout.directories) * len(pool._cgroups), held
        (group,) = pool._cgroups
        name = group.directories[0].rsplit("/", 1)[-1]
        assert all(name in run.stdout for run in runs), "a run did not join its group"
    assert _procs_descriptors() == before
