"""Cgroup layout detection (v1 and v2) from mountinfo, and per-run groups on this machine's kernel."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tether.sandbox.cgroups import CgroupLimits, CgroupVersion, RunCgroup, detect_layout, system_layout

V1_MOUNTINFO = """\
30 25 0:26 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
31 25 0:27 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
32 25 0:28 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
33 25 0:29 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
34 25 0:30 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_PROC_CGROUP = "4:memory:/jobs/42\n8:pids:/\n1:cpu:/\n2:cpuacct:/\n0::/\n"
V2_MOUNTINFO = "40 25 0:31 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw,nsdelegate\n"


def test_v1_layout_nests_under_this_process_group() -> None:
    layout = detect_layout(V1_MOUNTINFO, V1_PROC_CGROUP, v2_controllers=set())
    assert layout is not None and layout.version is CgroupVersion.V1
    assert layout.bases["memory"] == Path("/sys/fs/cgroup/memory/jobs/42/tether")
    assert set(layout.bases) == {"memory", "pids", "cpu"}


def test_comounted_cpu_and_cpuacct_hierarchy_is_used_for_cpu() -> None:
    lines = [line for line in V1_MOUNTINFO.splitlines(keepends=True) if "cpu" not in line]
    mountinfo = "".join(lines) + "35 25 0:26 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
    layout = detect_layout(mountinfo, "1:cpu,cpuacct:/\n4:memory:/\n8:pids:/\n", set())
    assert layout is not None
    assert layout.bases["cpu"] == Path("/sys/fs/cgroup/cpu,cpuacct/tether")


def test_v2_layout_when_controllers_are_delegated() -> None:
    layout = detect_layout(V2_MOUNTINFO, "0::/user.slice/job\n", {"memory", "pids", "cpu", "io"})
    assert layout is not None and layout.version is CgroupVersion.V2
    assert layout.directories == [Path("/sys/fs/cgroup/user.slice/job/tether")]


def test_v2_without_memory_controller_is_unusable() -> None:
    assert detect_layout(V2_MOUNTINFO, "0::/\n", {"pids", "cpu"}) is None


def test_v2_group_writes_limits_and_reads_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_mkdir = os.mkdir

    def mkdir_like_cgroupfs(path: str, mode: int = 0o777) -> None:
        real_mkdir(path, mode)
        for name in ("memory.max", "memory.swap.max", "pids.max", "cpu.max", "cgroup.procs"):
            Path(path, name).touch()

    monkeypatch.setattr(os, "mkdir", mkdir_like_cgroupfs)
    layout = detect_layout(
        V2_MOUNTINFO.replace("/sys/fs/cgroup", str(tmp_path)), "0::/\n", {"memory", "pids", "cpu"}
    )
    assert layout is not None
    base = tmp_path / "tether"
    real_mkdir(base)
    group = RunCgroup(layout, "run1")
    group.create(CgroupLimits(memory_bytes=64 << 20, pids_max=16, cpu_cores=0.5))
    directory = base / "run1"
    assert (directory / "memory.max").read_text() == str(64 << 20)
    assert (directory / "pids.max").read_text() == "16"
    assert (directory / "cpu.max").read_text() == "50000 100000"
    (directory / "memory.peak").write_text(str(3 << 20))
    (directory / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    stats = group.stats()
    assert (stats.peak_memory_kib, stats.oom_kills) == (3072, 1)


def test_real_run_cgroup_counts_an_oom_kill() -> None:
    layout = system_layout(namespace=f"tether-test-{os.getpid()}")
    assert layout is not None, "this machine must offer memory, pids and cpu cgroups"
    for directory in layout.directories:
        directory.mkdir(parents=True, exist_ok=True)
    group = RunCgroup(layout, "oom")
    group.create(CgroupLimits(memory_bytes=32 << 20, pids_max=8, cpu_cores=1))
    try:
        fds = group.procs_fds()
        pid = os.fork()
        if pid == 0:
            for fd in fds:
                os.write(fd, b"0")
            hog = bytearray()
            while True:
                hog += b"x" * (1 << 20)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status)
        stats = group.stats()
        assert stats.oom_kills >= 1
        assert stats.peak_memory_kib >= 30 * 1024
    finally:
        assert group.remove()
        for directory in layout.directories:
            directory.rmdir()
