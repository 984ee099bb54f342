"""A run's cgroup is recycled for the next run only as new: empty, its OOM kills and peak its own."""

from __future__ import annotations

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
